package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Files: a row per file and its content in chunk rows, each written by one
// short statement, so that a 200 MB upload never holds a transaction open
// (or its content in memory); the row is marked complete at the end, and
// only then listed or read.

const fileColumns = `id, tenant, filename, purpose, bytes, lines, complete, created_at, expires_at`

func scanFile(r scanner) (store.File, error) {
	var f store.File
	var created, expires int64
	err := r.Scan(&f.ID, &f.Tenant, &f.Filename, &f.Purpose, &f.Bytes, &f.Lines, &f.Complete, &created, &expires)
	f.CreatedAt, f.ExpiresAt = fromMicros(created), fromMicros(expires)
	return f, err
}

// CreateFile records a file about to be written (not complete yet).
func (s *Store) CreateFile(ctx context.Context, f store.File) error {
	_, err := s.db.ExecContext(ctx, rebind(s.d, `INSERT INTO files (`+fileColumns+`) VALUES (?, ?, ?, ?, 0, 0, ?, ?, ?)`),
		f.ID, f.Tenant, f.Filename, f.Purpose, false, micros(f.CreatedAt), micros(f.ExpiresAt))
	return s.err("create file", err)
}

// PutFileChunk writes the seq-th chunk (from 0) of a file being written.
func (s *Store) PutFileChunk(ctx context.Context, id string, seq int, data []byte) error {
	_, err := s.db.ExecContext(ctx, rebind(s.d, `INSERT INTO file_chunks (file_id, seq, data) VALUES (?, ?, ?)`), id, seq, data)
	return s.err("write file chunk", err)
}

// completeIs is col = v written as the files indexes' predicates are
// (migration 9: WHERE complete on PostgreSQL, complete = 1 on SQLite):
// the planners match a partial index's predicate only as written, and a
// bound value never matches it under PostgreSQL's generic plans (every
// tenant's files were read for one's).
func (s *Store) completeIs(col string, v bool) string {
	switch {
	case s.d.Name == "postgres" && v:
		return col
	case s.d.Name == "postgres":
		return "NOT " + col
	case v:
		return col + " = 1"
	}
	return col + " = 0"
}

// CompleteFile marks a tenant's file written, with its size, purpose and
// expiry (which an upload may learn only after the content).
func (s *Store) CompleteFile(ctx context.Context, f store.File) error {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE files SET complete = ?, bytes = ?, lines = ?, purpose = ?, expires_at = ?
		WHERE tenant = ? AND id = ? AND complete = ? AND created_at <> 0`),
		true, f.Bytes, f.Lines, f.Purpose, micros(f.ExpiresAt), f.Tenant, f.ID, false)
	if err != nil {
		return s.err("complete file", err)
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return store.ErrNotFound
	}
	return nil
}

// File returns a tenant's complete file; ErrNotFound for another
// tenant's, an incomplete or an expired one.
func (s *Store) File(ctx context.Context, tenant, id string, now time.Time) (store.File, error) {
	f, err := scanFile(s.db.QueryRowContext(ctx, rebind(s.d, `SELECT `+fileColumns+` FROM files
		WHERE tenant = ? AND id = ? AND `+s.completeIs("complete", true)+` AND (expires_at = 0 OR expires_at > ?)`), tenant, id, micros(now)))
	return f, s.err("get file", err)
}

// FileBytes is what a tenant's files hold at now: the complete,
// unexpired ones' bytes, and the chunks written so far of those still
// being written (a deleted file's rest, hidden, is not counted).
func (s *Store) FileBytes(ctx context.Context, tenant string, now time.Time) (int64, error) {
	var done, writing int64
	err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT
		(SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ? AND `+s.completeIs("complete", true)+` AND (expires_at = 0 OR expires_at > ?)),
		(SELECT COALESCE(SUM(LENGTH(c.data)), 0) FROM file_chunks c JOIN files f ON f.id = c.file_id
			WHERE f.tenant = ? AND `+s.completeIs("f.complete", false)+` AND f.created_at <> 0)`),
		tenant, micros(now), tenant).Scan(&done, &writing)
	return done + writing, s.err("file bytes", err)
}

// FileChunk returns the seq-th chunk of a file; ErrNotFound past its end.
func (s *Store) FileChunk(ctx context.Context, id string, seq int) ([]byte, error) {
	var b []byte
	err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT data FROM file_chunks WHERE file_id = ? AND seq = ?`), id, seq).Scan(&b)
	return b, s.err("read file chunk", err)
}

// ListFiles returns a page of a tenant's complete, unexpired files, and
// whether more follow.
func (s *Store) ListFiles(ctx context.Context, tenant string, f store.FileFilter, now time.Time) ([]store.File, bool, error) {
	limit := f.Limit
	if limit <= 0 || limit > 10000 {
		limit = 10000
	}
	q := `SELECT ` + fileColumns + ` FROM files WHERE tenant = ? AND ` + s.completeIs("complete", true) + ` AND (expires_at = 0 OR expires_at > ?)`
	args := []any{tenant, micros(now)}
	if f.Purpose != "" {
		q += ` AND purpose = ?`
		args = append(args, f.Purpose)
	}
	order := ` ORDER BY id DESC LIMIT ?`
	if f.After != "" {
		q += ` AND id < ?`
		if f.Asc {
			q = q[:len(q)-len(`id < ?`)] + `id > ?`
		}
		args = append(args, f.After)
	}
	if f.Asc {
		order = ` ORDER BY id LIMIT ?`
	}
	rows, err := s.db.QueryContext(ctx, rebind(s.d, q+order), append(args, limit+1)...)
	if err != nil {
		return nil, false, s.err("list files", err)
	}
	defer rows.Close()
	var out []store.File
	for rows.Next() {
		fl, err := scanFile(rows)
		if err != nil {
			return nil, false, s.err("list files", err)
		}
		out = append(out, fl)
	}
	if err := rows.Err(); err != nil {
		return nil, false, s.err("list files", err)
	}
	out, more := cutPage(out, limit)
	return out, more, nil
}

// DeleteFile deletes a tenant's file and its content, complete or not.
// The file is hidden first, in one statement: from then on no read finds
// it, a second delete finds nothing (ErrNotFound), and its content goes
// even if the caller leaves; a drop cut short by the database leaves a
// hidden file (incomplete, created at 0) for SweepFiles.
func (s *Store) DeleteFile(ctx context.Context, tenant, id string) error {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE files SET complete = ?, created_at = 0
		WHERE tenant = ? AND id = ? AND created_at <> 0`), false, tenant, id)
	if err != nil {
		return s.err("delete file", err)
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return store.ErrNotFound
	}
	// Deleted as the caller sees it from here: a drop cut short is the
	// sweep's to finish, not a failure to report (a client retrying it
	// would be told the file does not exist).
	_ = s.dropFile(context.WithoutCancel(ctx), id)
	return nil
}

// dropFile deletes a file's chunks a few at a time (each statement
// short), then its row.
func (s *Store) dropFile(ctx context.Context, id string) error {
	for {
		res, err := s.db.ExecContext(ctx, rebind(s.d, `DELETE FROM file_chunks WHERE file_id = ? AND seq IN (
			SELECT seq FROM file_chunks WHERE file_id = ? ORDER BY seq LIMIT 32)`), id, id)
		if err != nil {
			return s.err("delete file", err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			break
		}
	}
	_, err := s.db.ExecContext(ctx, rebind(s.d, `DELETE FROM files WHERE id = ?`), id)
	return s.err("delete file", err)
}

// SweepFiles deletes up to limit files that will never be read: those
// left incomplete since before staleBefore (an upload cut off, a
// finalization overtaken by another) and those expired by now. It
// returns how many it deleted.
func (s *Store) SweepFiles(ctx context.Context, staleBefore, now time.Time, limit int) (int, error) {
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT id FROM files WHERE `+s.completeIs("complete", false)+` AND created_at < ?
		UNION ALL SELECT id FROM files WHERE expires_at > 0 AND expires_at <= ? LIMIT ?`), micros(staleBefore), micros(now), limit)
	if err != nil {
		return 0, s.err("sweep files", err)
	}
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return 0, s.err("sweep files", err)
		}
		ids = append(ids, id)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, s.err("sweep files", err)
	}
	n := 0
	for _, id := range ids {
		if err := s.dropFile(ctx, id); err != nil && !errors.Is(err, sql.ErrNoRows) {
			return n, err
		}
		n++
	}
	return n, nil
}

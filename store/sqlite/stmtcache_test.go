package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
)

// openCached opens a one-connection database through the caching
// connector, and returns it with that connection's cache.
func openCached(t *testing.T) (*sql.DB, func() map[string]*cachedStmt) {
	t.Helper()
	conn, err := newCachingConnector("file:" + filepath.Join(t.TempDir(), "c.db") + "?_pragma=journal_mode(WAL)&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { db.Close() })
	cache := func() map[string]*cachedStmt {
		var m map[string]*cachedStmt
		c, err := db.Conn(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.Raw(func(dc any) error {
			m = dc.(*cachingConn).stmts
			return nil
		})
		return m
	}
	return db, cache
}

func TestStmtCacheReuses(t *testing.T) {
	ctx := context.Background()
	db, cache := openCached(t)
	if _, err := db.ExecContext(ctx, `CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER NOT NULL); CREATE INDEX t_v ON t (v)`); err != nil {
		t.Fatal(err)
	}
	if n := len(cache()); n != 0 {
		t.Fatalf("a script was cached: %d statements", n)
	}
	const ins = `INSERT INTO t (k, v) VALUES (?, ?)`
	for i, k := range []string{"a", "b", "c"} {
		if _, err := db.ExecContext(ctx, ins, k, i); err != nil {
			t.Fatal(err)
		}
	}
	first := cache()[ins]
	if first == nil {
		t.Fatal("the insert was not cached")
	}
	// A failing run leaves the statement usable.
	if _, err := db.ExecContext(ctx, ins, "a", 9); err == nil {
		t.Fatal("a duplicate key was inserted")
	}
	if _, err := db.ExecContext(ctx, ins, "d", 3); err != nil {
		t.Fatalf("the cached insert after a failed one: %v", err)
	}
	if cache()[ins] != first {
		t.Error("the insert was prepared again")
	}

	const sel = `SELECT k FROM t WHERE v >= ? ORDER BY k`
	rows, err := db.QueryContext(ctx, sel, 0)
	if err != nil {
		t.Fatal(err)
	}
	var outer []string
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		outer = append(outer, k)
	}
	if err := rows.Close(); err != nil {
		t.Fatal(err)
	}
	if len(outer) != 4 {
		t.Fatalf("rows %v", outer)
	}
	// The same query again while its rows are open (in one transaction,
	// so on one connection) runs uncached, and each sees its own rows.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	r1, err := tx.QueryContext(ctx, sel, 2)
	if err != nil {
		t.Fatal(err)
	}
	if !r1.Next() {
		t.Fatal("no first row")
	}
	var k1, k2 string
	if err := r1.Scan(&k1); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRowContext(ctx, sel, 0).Scan(&k2); err != nil {
		t.Fatalf("the same query with the first one's rows open: %v", err)
	}
	if !r1.Next() {
		t.Fatal("the first query lost its second row")
	}
	var k3 string
	if err := r1.Scan(&k3); err != nil {
		t.Fatal(err)
	}
	r1.Close()
	if k1 != "c" || k3 != "d" || k2 != "a" {
		t.Errorf("outer rows %q, %q; inner %q; want c, d and a", k1, k3, k2)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}

	// A schema change under a cached statement: SQLite prepares it again.
	if _, err := db.ExecContext(ctx, `ALTER TABLE t ADD COLUMN w INTEGER NOT NULL DEFAULT 7`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, ins, "e", 4); err != nil {
		t.Fatalf("the cached insert after the schema changed: %v", err)
	}
	var w int
	if err := db.QueryRowContext(ctx, `SELECT w FROM t WHERE k = ?`, "e").Scan(&w); err != nil || w != 7 {
		t.Errorf("the new column: %d, %v", w, err)
	}
}

func TestStmtCacheBounded(t *testing.T) {
	ctx := context.Background()
	db, cache := openCached(t)
	for i := range maxCachedStmts + 10 {
		var n int
		// Distinct texts, as bulk inserts of varying sizes make.
		q := fmt.Sprintf("SELECT %d + ?", i)
		if err := db.QueryRowContext(ctx, q, 1).Scan(&n); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(cache()); n != maxCachedStmts {
		t.Errorf("%d statements cached, want the bound %d", n, maxCachedStmts)
	}
}

func TestWriteGate(t *testing.T) {
	ctx := context.Background()
	conn, err := newCachingConnector("file:" + filepath.Join(t.TempDir(), "g.db") + "?_pragma=journal_mode(WAL)&_pragma=busy_timeout(10000)&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(4)
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE TABLE n (id INTEGER PRIMARY KEY, v INTEGER NOT NULL); INSERT INTO n VALUES (1, 0)`); err != nil {
		t.Fatal(err)
	}

	// Writers in transactions and outside them, at once: each one's
	// increment counts, and none fails for a lock.
	const writers, each = 8, 50
	errs := make(chan error, writers)
	for w := range writers {
		go func() {
			for range each {
				if w%2 == 0 {
					if _, err := db.ExecContext(ctx, `UPDATE n SET v = v + 1 WHERE id = 1`); err != nil {
						errs <- err
						return
					}
					continue
				}
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					errs <- err
					return
				}
				var v int
				if err := tx.QueryRowContext(ctx, `SELECT v FROM n WHERE id = 1`).Scan(&v); err != nil {
					tx.Rollback()
					errs <- err
					return
				}
				if _, err := tx.ExecContext(ctx, `UPDATE n SET v = ? WHERE id = 1`, v+1); err != nil {
					tx.Rollback()
					errs <- err
					return
				}
				if err := tx.Commit(); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range writers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	var v int
	if err := db.QueryRowContext(ctx, `SELECT v FROM n WHERE id = 1`).Scan(&v); err != nil || v != writers*each {
		t.Fatalf("the counter reads %d (%v), want %d", v, err, writers*each)
	}
	if len(conn.(cachingConnector).gate.ch) != 0 {
		t.Fatal("the gate is still held after every writer ended")
	}

	// While a transaction holds the gate, another writer whose context
	// ends gives up with the context's error; a reader is not held.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := db.BeginTx(short, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("a second writer with its context ended: %v, want context.Canceled", err)
	}
	ro, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		t.Fatalf("a reader beside a writer: %v", err)
	}
	if err := ro.QueryRowContext(ctx, `SELECT v FROM n WHERE id = 1`).Scan(&v); err != nil {
		t.Fatal(err)
	}
	ro.Rollback()
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if len(conn.(cachingConnector).gate.ch) != 0 {
		t.Fatal("the gate is held after the rollback")
	}
}

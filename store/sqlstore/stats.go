package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Stats implements store.StatsReader: the runnable backlog grouped by
// tenant, the jobs API's apart from the Batch API's lines (one scan of a runnable-jobs partial index, whose
// size is the backlog, never the finished jobs: the condition states
// jobs_runnable's whole predicate, so either index may serve it) and the
// oldest unpublished outbox event (the head of the outbox_unpublished
// partial index). The runnable condition is the claim's own
// (ownership.go).
func (s *Store) Stats(ctx context.Context, now time.Time) (store.Stats, error) {
	var st store.Stats
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT jobs.tenant, MIN(jobs.priority), COUNT(*), COALESCE(SUM(jobs.token_estimate), 0),
		MIN(jobs.available_at) FROM jobs WHERE `+runnable("jobs", "?")+` AND `+claimOrderIndexed("jobs")+` GROUP BY jobs.tenant, jobs.priority > 0
		ORDER BY jobs.tenant, 2`), micros(now), micros(now))
	if err != nil {
		return st, s.err("stats", err)
	}
	defer rows.Close()
	for rows.Next() {
		var b store.Backlog
		var oldest int64
		if err := rows.Scan(&b.Tenant, &b.Priority, &b.Jobs, &b.Tokens, &oldest); err != nil {
			return st, s.err("stats", err)
		}
		b.OldestAvailable = fromMicros(oldest)
		st.Backlog = append(st.Backlog, b)
	}
	if err := rows.Err(); err != nil {
		return st, s.err("stats", err)
	}
	var created int64
	err = s.db.QueryRowContext(ctx, `SELECT MIN(created_at) FROM (
			SELECT * FROM (SELECT created_at FROM outbox WHERE published_at = 0 ORDER BY seq LIMIT 1) unplaced
			UNION ALL
			SELECT * FROM (SELECT created_at FROM outbox WHERE published_at = `+placed+` ORDER BY feed_seq LIMIT 1) placed) o
		HAVING COUNT(*) > 0`).Scan(&created)
	switch {
	case errors.Is(err, sql.ErrNoRows):
	case err != nil:
		return st, s.err("stats", err)
	default:
		st.OldestUnpublished = fromMicros(created)
	}
	return st, nil
}

var _ store.StatsReader = (*Store)(nil)

package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/kvgate/kvgate/store"
)

// The inbox's batch: a fetch of delivered events recorded by one
// statement (PostgreSQL) or in one transaction (SQLite), so that the
// inbox costs the database one commit per fetch instead of one per
// event. A job's three events (accepted, running, ended) were three
// commits each, more than the job's own writes.

// recordInboxBatch inserts the batch's first mention of each id, and
// returns the ids it inserted (digest "", TRUE) and the records already
// there (their digest, FALSE). The main query sees the snapshot before
// the insert, so an id inserted here is never in the second part; an id
// in neither was inserted by a transaction that committed while this one
// waited on it, and is read again afterwards.
const recordInboxBatch = `WITH input AS (
		SELECT * FROM unnest(?::text[], ?::text[]) WITH ORDINALITY AS t(event_id, digest, ord)),
	ins AS (
		INSERT INTO inbox (event_id, digest, received_at)
		SELECT DISTINCT ON (event_id) event_id, digest, ? FROM input ORDER BY event_id, ord
		ON CONFLICT (event_id) DO NOTHING
		RETURNING event_id)
	SELECT event_id, '', TRUE FROM ins
	UNION ALL
	SELECT event_id, digest, FALSE FROM inbox WHERE event_id = ANY(?::text[])`

func inboxBatchQueries(d Dialect, q *queries) {
	if d.WritableCTE {
		q.recordInboxBatch = rebind(d, recordInboxBatch)
	}
}

// RecordInboxBatch implements store.Store.
func (s *Store) RecordInboxBatch(ctx context.Context, recs []store.InboxRecord, now time.Time) ([]store.InboxOutcome, error) {
	if len(recs) == 0 {
		return nil, nil
	}
	inserted := map[string]bool{} // ids this call inserted
	have := map[string]string{}   // digests recorded before, by id
	if s.q.recordInboxBatch != "" {
		ids, digests := make([]string, len(recs)), make([]string, len(recs))
		for i, r := range recs {
			ids[i], digests[i] = r.EventID, r.Digest
		}
		err := func() error {
			rows, err := s.query(ctx, nil, s.q.recordInboxBatch, ids, digests, micros(now), ids)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				var id, digest string
				var isNew bool
				if err := rows.Scan(&id, &digest, &isNew); err != nil {
					return err
				}
				if isNew {
					inserted[id] = true
				} else {
					have[id] = digest
				}
			}
			return rows.Err()
		}()
		if err != nil {
			return nil, s.err("record inbox events", err)
		}
		// Committed. An id in neither part was recorded by another
		// transaction meanwhile: read it now.
		for _, r := range recs {
			if _, ok := have[r.EventID]; ok || inserted[r.EventID] {
				continue
			}
			var d string
			if err := s.queryRow(ctx, nil, s.q.selectInbox, r.EventID).Scan(&d); err != nil {
				return nil, s.err("record inbox events", err)
			}
			have[r.EventID] = d
		}
	} else {
		err := s.tx(ctx, "record inbox events", func(tx *sql.Tx) error {
			for _, r := range recs {
				if _, ok := have[r.EventID]; ok || inserted[r.EventID] {
					continue // mentioned before in this batch
				}
				res, err := s.exec(ctx, tx, s.q.insertInbox, r.EventID, r.Digest, micros(now))
				if err != nil {
					return err
				}
				if n, err := res.RowsAffected(); err != nil {
					return err
				} else if n == 1 {
					inserted[r.EventID] = true
					continue
				}
				var d string
				if err := s.queryRow(ctx, tx, s.q.selectInbox, r.EventID).Scan(&d); err != nil {
					if errors.Is(err, sql.ErrNoRows) {
						return errors.New("inbox record neither inserted nor found")
					}
					return err
				}
				have[r.EventID] = d
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return inboxOutcomes(recs, inserted, have), nil
}

// inboxOutcomes gives each record its outcome, in order: the first
// mention of an id this call inserted is recorded; any other mention is
// compared with the digest recorded first (here or before).
func inboxOutcomes(recs []store.InboxRecord, inserted map[string]bool, have map[string]string) []store.InboxOutcome {
	out := make([]store.InboxOutcome, len(recs))
	first := map[string]string{} // digest of an id's first mention, for those inserted
	for i, r := range recs {
		d, before := have[r.EventID]
		if !before {
			if fd, seen := first[r.EventID]; seen {
				d = fd
			} else {
				first[r.EventID] = r.Digest
				out[i] = store.InboxRecorded
				continue
			}
		}
		if d == r.Digest {
			out[i] = store.InboxDuplicate
		} else {
			out[i] = store.InboxMismatch
		}
	}
	return out
}

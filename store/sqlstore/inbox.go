package sqlstore

import (
	"context"
	"time"
)

// PruneInbox implements store.Store.
func (s *Store) PruneInbox(ctx context.Context, before time.Time, limit int) (int, error) {
	res, err := s.exec(ctx, nil, rebind(s.d, `DELETE FROM inbox WHERE event_id IN (
		SELECT event_id FROM inbox WHERE received_at < ? ORDER BY received_at LIMIT ?)`), micros(before), limit)
	if err != nil {
		return 0, s.err("prune inbox", err)
	}
	n, err := res.RowsAffected()
	return int(n), s.err("prune inbox", err)
}

package sqlstore

import "context"

// FeedHead implements store.Store.
func (s *Store) FeedHead(ctx context.Context, tenant string) (int64, error) {
	var head int64
	err := s.queryRow(ctx, nil, rebind(s.d, `SELECT COALESCE(MAX(feed_seq), 0) FROM outbox WHERE tenant = ? AND feed_seq IS NOT NULL`), tenant).Scan(&head)
	return head, s.err("read feed head", err)
}

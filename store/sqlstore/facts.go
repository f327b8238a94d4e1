package sqlstore

import (
	"context"
	"strings"

	"github.com/kvgate/kvgate/store"
)

// AttemptFacts reads, for many jobs in one statement, what an attempt
// reads of its job before its stages: the job's entity version (as
// JobEntity reads it) and its pinned policy (as JobOutcome reads it). A
// job that names no entity has no entry in entities, one without a
// policy none in outcomes. Both are written with the job at acceptance;
// only a replay, of a job that has ended, re-pins its policy, so what a
// read right after a claim says holds for the attempts of that claim.
// The runner reads them once per claim instead of twice per job. It is
// safe for concurrent use; its errors are the store's (ErrUnavailable).
func (s *Store) AttemptFacts(ctx context.Context, ids []string) (entities map[string]store.JobEntity, outcomes map[string]store.JobOutcome, err error) {
	entities, outcomes = map[string]store.JobEntity{}, map[string]store.JobOutcome{}
	if len(ids) == 0 {
		return entities, outcomes, nil
	}
	// A few statement shapes, not one per count: the list is padded to a
	// power of two with its last id (each shape is prepared once per
	// connection; a repeated id matches the same rows).
	n := 1
	for n < len(ids) {
		n *= 2
	}
	args := make([]any, 0, 2*n)
	for range 2 {
		for i := range n {
			args = append(args, ids[min(i, len(ids)-1)])
		}
	}
	in := "(" + strings.TrimSuffix(strings.Repeat("?, ", n), ", ") + ")"
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT 0, job_id, tenant, entity_key, entity_version, ordering, NULL
		FROM job_entities WHERE job_id IN `+in+`
		UNION ALL
		SELECT 1, o.job_id, o.tenant, o.policy_name, o.policy_version, o.source, p.document
		FROM job_outcomes o JOIN validation_policies p ON p.tenant = o.tenant AND p.name = o.policy_name AND p.version = o.policy_version
		WHERE o.job_id IN `+in), args...)
	if err != nil {
		return nil, nil, s.err("read attempt facts", err)
	}
	defer rows.Close()
	for rows.Next() {
		var kind int
		var id, tenant, name, text string
		var version int64
		var doc []byte
		if err := rows.Scan(&kind, &id, &tenant, &name, &version, &text, &doc); err != nil {
			return nil, nil, s.err("read attempt facts", err)
		}
		if kind == 0 {
			entities[id] = store.JobEntity{JobID: id, Tenant: tenant, Key: name, Version: version, Ordering: text}
		} else {
			outcomes[id] = store.JobOutcome{JobID: id, Tenant: tenant, Policy: name, Version: int(version), Document: doc, Source: text}
		}
	}
	if err := rows.Err(); err != nil {
		return nil, nil, s.err("read attempt facts", err)
	}
	return entities, outcomes, nil
}

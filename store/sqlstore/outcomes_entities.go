package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Per-entity ordering (store/entities.go).

// finalStatesSQL is store.FinalStates as an SQL list: ('SUCCEEDED', ...).
func finalStatesSQL() string {
	q := make([]string, len(store.FinalStates))
	for i, st := range store.FinalStates {
		q[i] = "'" + string(st) + "'"
	}
	return "(" + strings.Join(q, ", ") + ")"
}

// pinEntity writes a new job's entity version in Accept's transaction.
func (s *Store) pinEntity(ctx context.Context, tx *sql.Tx, j store.Job, e *store.NewEntity) error {
	ordering := e.Ordering
	if ordering == "" {
		ordering = store.OrderLatest
	}
	if _, err := tx.ExecContext(ctx, rebind(s.d, `INSERT INTO entities (tenant, entity_key) VALUES (?, ?)
		ON CONFLICT (tenant, entity_key) DO NOTHING`), j.Tenant, e.Key); err != nil {
		return err
	}
	res, err := tx.ExecContext(ctx, rebind(s.d, `INSERT INTO job_entities (job_id, tenant, entity_key, entity_version, ordering)
		VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, entity_key, entity_version) DO NOTHING`), j.ID, j.Tenant, e.Key, e.Version, ordering)
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil {
		return err
	} else if n == 0 {
		return store.ErrEntityVersionExists
	}
	return nil
}

// JobEntity implements store.Entities.
func (s *Store) JobEntity(ctx context.Context, jobID string) (store.JobEntity, error) {
	var e store.JobEntity
	err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT job_id, tenant, entity_key, entity_version, ordering FROM job_entities
		WHERE job_id = ?`), jobID).Scan(&e.JobID, &e.Tenant, &e.Key, &e.Version, &e.Ordering)
	return e, s.err("get job entity", err)
}

// EntityTurn implements store.Entities.
func (s *Store) EntityTurn(ctx context.Context, e store.JobEntity) (store.Turn, error) {
	var won int64
	if err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT won_version FROM entities WHERE tenant = ? AND entity_key = ?`),
		e.Tenant, e.Key).Scan(&won); err != nil {
		return store.TurnRun, s.err("entity turn", err)
	}
	if won > e.Version {
		return store.TurnSuperseded, nil
	}
	if e.Ordering != store.OrderSerial {
		return store.TurnRun, nil
	}
	var n int
	if err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT count(*) FROM job_entities je JOIN jobs ON jobs.id = je.job_id
		WHERE je.tenant = ? AND je.entity_key = ? AND je.entity_version < ? AND jobs.state NOT IN `+finalStatesSQL()),
		e.Tenant, e.Key, e.Version).Scan(&n); err != nil {
		return store.TurnRun, s.err("entity turn", err)
	}
	if n > 0 {
		return store.TurnWait, nil
	}
	return store.TurnRun, nil
}

// completeEntity ends an entity job's attempt in one transaction that
// first locks the entity's row and reads its winning version: a version
// below it ends SUPERSEDED; a version that SUCCEEDED above it becomes the
// winner, and the lower versions not yet started are superseded without
// running. The lock serialises the completions of one entity across
// replicas, so two versions finishing at once cannot both win.
func (s *Store) completeEntity(ctx context.Context, je store.JobEntity, e *end) error {
	return s.tx(ctx, e.op, func(tx *sql.Tx) error {
		won, err := s.lockEntity(ctx, tx, je)
		if err != nil {
			return err
		}
		wins := false
		switch {
		case won > je.Version:
			e.state = store.Superseded
		case e.state == store.Succeeded:
			wins = true
		}
		if err := s.finishEntityTx(ctx, tx, e); err != nil {
			return err
		}
		if !wins {
			return nil
		}
		return s.winEntity(ctx, tx, je, e.now)
	})
}

// lockEntity locks the entity's row for the rest of tx (SQLite's write
// transaction holds the whole database) and returns its winning version.
// Every decision that a version succeeded goes through it: the runner's
// completion and an operator's approval.
func (s *Store) lockEntity(ctx context.Context, tx *sql.Tx, je store.JobEntity) (int64, error) {
	lock := s.forUpdate()
	var won int64
	err := tx.QueryRowContext(ctx, rebind(s.d, `SELECT won_version FROM entities WHERE tenant = ? AND entity_key = ?`+lock),
		je.Tenant, je.Key).Scan(&won)
	return won, err
}

// txJobEntity is the entity a job names, read inside tx; ok is false for
// a job that names none.
func (s *Store) txJobEntity(ctx context.Context, tx *sql.Tx, jobID string) (store.JobEntity, bool, error) {
	var e store.JobEntity
	err := tx.QueryRowContext(ctx, rebind(s.d, `SELECT job_id, tenant, entity_key, entity_version, ordering FROM job_entities
		WHERE job_id = ?`), jobID).Scan(&e.JobID, &e.Tenant, &e.Key, &e.Version, &e.Ordering)
	if errors.Is(err, sql.ErrNoRows) {
		return e, false, nil
	}
	return e, err == nil, err
}

// winEntity records that je's version succeeded, under the lock that
// lockEntity took: it becomes the entity's winner, and its lower versions
// not yet started end SUPERSEDED without running.
func (s *Store) winEntity(ctx context.Context, tx *sql.Tx, je store.JobEntity, now time.Time) error {
	if _, err := tx.ExecContext(ctx, rebind(s.d, `UPDATE entities SET won_version = ? WHERE tenant = ? AND entity_key = ?`),
		je.Version, je.Tenant, je.Key); err != nil {
		return err
	}
	rows, err := tx.QueryContext(ctx, rebind(s.d, `UPDATE jobs SET state = 'SUPERSEDED', state_version = state_version + 1,
		updated_at = ?, error_class = '', last_error = 'a later version of its entity succeeded first'
		WHERE id IN (SELECT job_id FROM job_entities WHERE tenant = ? AND entity_key = ? AND entity_version < ?)
			AND state IN ('READY', 'RETRY_SCHEDULED')
		RETURNING id, tenant, state_version`), micros(now), je.Tenant, je.Key, je.Version)
	if err != nil {
		return err
	}
	type sup struct {
		id, tenant string
		version    int64
	}
	var sups []sup
	for rows.Next() {
		var x sup
		if err := rows.Scan(&x.id, &x.tenant, &x.version); err != nil {
			rows.Close()
			return err
		}
		sups = append(sups, x)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, x := range sups {
		if err := s.addEvent(ctx, tx, "", x.id, x.tenant, store.Superseded, x.version, now); err != nil {
			return err
		}
	}
	return nil
}

// Entity implements store.Entities.
func (s *Store) Entity(ctx context.Context, tenant, key string, limit int) (store.Entity, error) {
	ent := store.Entity{Tenant: tenant, Key: key}
	err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT won_version FROM entities WHERE tenant = ? AND entity_key = ?`), tenant, key).Scan(&ent.WonVersion)
	if errors.Is(err, sql.ErrNoRows) {
		return ent, store.ErrNotFound
	}
	if err != nil {
		return ent, s.err("get entity", err)
	}
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT je.entity_version, je.job_id, jobs.state FROM job_entities je
		JOIN jobs ON jobs.id = je.job_id WHERE je.tenant = ? AND je.entity_key = ? ORDER BY je.entity_version DESC LIMIT ?`),
		tenant, key, pageLimit(limit))
	if err != nil {
		return ent, s.err("get entity", err)
	}
	defer rows.Close()
	for rows.Next() {
		var v store.EntityVersion
		var st string
		if err := rows.Scan(&v.Version, &v.JobID, &st); err != nil {
			return ent, s.err("get entity", err)
		}
		v.State = store.State(st)
		ent.Versions = append(ent.Versions, v)
	}
	if err := rows.Err(); err != nil {
		return ent, s.err("get entity", err)
	}
	if len(ent.Versions) == 0 {
		return ent, store.ErrNotFound // every version pruned
	}
	return ent, nil
}

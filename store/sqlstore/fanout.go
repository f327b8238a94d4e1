package sqlstore

import (
	"github.com/kvgate/kvgate/store"
)

// The webhook fan-out, the one rule that makes deliveries: every outbox
// event that an endpoint may subscribe to (store.WebhookEvents; a
// job.dead_lettered is delivered as job.failed) makes, in the transaction
// that commits the event, one PENDING delivery for each enabled endpoint
// of the event's tenant subscribed to it, in the events' order and then
// the endpoints'.
//
// Where the database has writable CTEs (PostgreSQL), the statement that
// inserts the events makes their deliveries in the same statement:
// every INSERT INTO outbox is written through eventsCTE or
// eventsStatement. Until migration 25 a statement-level trigger on the
// outbox did it, and it cost every statement that wrote events a
// transition table of its new rows and a PL/pgSQL call, claims and
// acceptances included, whose events (job.running, job.accepted) no
// endpoint can subscribe to: about 30 µs a statement, a fifth of a
// one-event insert (docs/benchmarks.md, "The webhook fan-out in the
// statements that write events"). Migration 25 keeps a row trigger for
// the writes of earlier releases only, which kvgate's connections skip
// (store/postgres sets kvgate.fanout; TestEventsFanOut checks that every
// insert into the outbox here goes through these functions). Without
// writable CTEs (SQLite) the outbox's row trigger (migration 13) does it
// for every insert, and these functions leave the statements as they
// are.

// deliveredAs is the name under which events of type t are delivered.
func deliveredAs(t string) string {
	if t == "job.dead_lettered" {
		return "job.failed"
	}
	return t
}

// mayFanOut reports whether events of type typ ("" when it varies by
// row) may make deliveries.
func mayFanOut(typ string) bool {
	return typ == "" || store.ValidWebhookEvent(deliveredAs(typ))
}

// deliveredAsSQL is deliveredAs in SQL, of a type column.
func deliveredAsSQL(col string) string {
	return "CASE " + col + " WHEN 'job.dead_lettered' THEN 'job.failed' ELSE " + col + " END"
}

// eventsCTE is the CTE "ev" of a statement with writable CTEs that
// inserts events by insert (an INSERT INTO outbox of the columns id,
// job_id, tenant, type, state, state_version and created_at, with no
// RETURNING), followed, unless typ says that none can make a delivery, by
// the CTE that fans them out. typ is the events' type where the statement
// writes one, "" where it varies.
func eventsCTE(typ, insert string) string {
	if !mayFanOut(typ) {
		return "ev AS (" + insert + ")"
	}
	return "ev AS (" + insert + eventsReturning + "),\n\tev_deliveries AS (" + fanout + ")"
}

// eventsStatement is a statement of its own that inserts events by
// insert (as eventsCTE's) and, where the database has writable CTEs,
// fans them out; without them (SQLite) it is insert, and the outbox's
// trigger fans out. Its rows affected are not the events'.
func eventsStatement(d Dialect, typ, insert string) string {
	if !d.WritableCTE || !mayFanOut(typ) {
		return insert
	}
	return "WITH ev AS (" + insert + eventsReturning + ")\n" + fanout
}

const eventsReturning = "\n\t\tRETURNING seq, id, job_id, tenant, type, state, state_version, created_at"

// fanout inserts the deliveries of the events of CTE ev.
var fanout = `INSERT INTO webhook_deliveries (id, endpoint_id, tenant, event_id, job_id, type, job_state, state_version, event_at,
			state, due_at, created_at, updated_at)
		SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, ev.tenant, ev.id, ev.job_id, ` + deliveredAsSQL("ev.type") + `,
			ev.state, ev.state_version, ev.created_at, 'PENDING', ev.created_at, ev.created_at, ev.created_at
		FROM ev JOIN webhook_endpoints e ON e.tenant = ev.tenant
			AND position(',' || ` + deliveredAsSQL("ev.type") + ` || ',' IN e.events) > 0
		ORDER BY ev.seq, e.id`

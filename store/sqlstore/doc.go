// Package sqlstore implements store.Store once, over database/sql, for the
// SQL dialects of store/postgres and store/sqlite. A Dialect says what
// differs: placeholders, row locking for claims, the schema's types, which
// driver errors mean the database is unreachable, and whether writes can
// go inside WITH.
//
// Where they can (PostgreSQL), the hot operations are single statements:
// Accept, Claim, Complete and Fail each write the job, its attempt record
// and its events in one round trip and one implicit transaction. Accepts,
// and Completes and Fails, that arrive together from many goroutines are
// group-committed: written by one statement in one transaction per batch
// (group.go, batch.go), each caller still getting its own result, and a
// failing call failing alone. Elsewhere (SQLite, in process) each
// operation is an explicit transaction.
//
// Ownership of a job lives in one file, ownership.go: every statement
// that claims a job, renews or uses a claim, ends an attempt or reaps an
// expired one, built from the runnable and owned conditions and the one
// rule that decides between a retry and a terminal failure. fair.go is
// the fair claim's choice of jobs across tenants.
//
// Times are stored as Unix microseconds (BIGINT), so both databases order
// and compare them alike. The package is the implementation behind the two
// backends; other packages use it through them.
package sqlstore

// Package sqlstore implements store.Store once, over database/sql, for the
// SQL dialects of store/postgres and store/sqlite. A Dialect says what
// differs: placeholders, row locking for claims, the schema's types, and
// which driver errors mean the database is unreachable.
//
// Times are stored as Unix microseconds (BIGINT), so both databases order
// and compare them alike. The package is the implementation behind the two
// backends; other packages use it through them.
package sqlstore

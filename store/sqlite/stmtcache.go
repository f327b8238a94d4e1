package sqlite

import (
	"context"
	"database/sql/driver"
	"reflect"
	"strings"

	"modernc.org/sqlite"
)

// The statement cache. The store runs the same few hundred statements over
// and over, through database/sql's Exec and Query, which hand the driver
// the SQL text each time: modernc's connection then parses and plans it
// anew and finalizes it afterwards. On the interactive path (a quota permit
// taken and given back per request) parsing was a quarter of kvgate's CPU.
// This wrapper keeps, per connection, the prepared statement of each query
// it has run and binds the next call's arguments to it; SQLite re-prepares a
// cached statement by itself when the schema changes under it.
//
// A statement in use (its rows still open) is never handed out twice: the
// second caller runs its query uncached. Scripts (several statements, the
// migrations) always run uncached, as does everything once a connection
// holds maxCachedStmts statements.

// maxCachedStmts bounds one connection's cache. The store's statements
// are fixed texts but for bulk inserts, whose placeholder count varies.
const maxCachedStmts = 512

// newCachingConnector opens connections to dsn whose statements are kept.
func newCachingConnector(dsn string) (driver.Connector, error) {
	base, err := sqlite.NewConnector(dsn)
	if err != nil {
		return nil, err
	}
	return cachingConnector{base: base, gate: newWriteGate()}, nil
}

type cachingConnector struct {
	base driver.Connector
	gate *writeGate // one per database: shared by its connections
}

func (c cachingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	cn, err := c.base.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &cachingConn{Conn: cn, stmts: map[string]*cachedStmt{}, gate: c.gate}, nil
}

func (c cachingConnector) Driver() driver.Driver { return c.base.Driver() }

// The interfaces every connection modernc opens implements, which the
// wrapper must forward (connector.go in modernc.org/sqlite).
type sqliteConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.ExecerContext
	driver.QueryerContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
}

// cachingConn is one connection and its statements. database/sql never
// uses a connection from two goroutines at once, so it takes no lock.
type cachingConn struct {
	driver.Conn
	stmts map[string]*cachedStmt
	gate  *writeGate
	inTx  bool   // a transaction is open on this connection
	endTx func() // ends it: leaves the gate, once
}

type cachedStmt struct {
	s    driver.Stmt
	busy bool // its rows are open
}

var (
	_ sqliteConn                    = (*cachingConn)(nil)
	_ driver.RowsColumnTypeScanType = (*cachedRows)(nil)
)

// Unwrap returns the driver's connection (modernc's Limit looks through
// wrappers with it).
func (c *cachingConn) Unwrap() driver.Conn { return c.Conn }

func (c *cachingConn) inner() sqliteConn { return c.Conn.(sqliteConn) }

// script reports whether query holds more than one statement.
func script(query string) bool {
	i := strings.IndexByte(query, ';')
	return i >= 0 && strings.TrimSpace(query[i+1:]) != ""
}

// stmt returns query's cached statement, preparing it on first use, or nil
// when the query must run uncached.
func (c *cachingConn) stmt(ctx context.Context, query string) (*cachedStmt, error) {
	if cs, ok := c.stmts[query]; ok {
		if cs.busy {
			return nil, nil
		}
		return cs, nil
	}
	if len(c.stmts) >= maxCachedStmts || script(query) {
		return nil, nil
	}
	s, err := c.inner().PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	cs := &cachedStmt{s: s}
	c.stmts[query] = cs
	return cs, nil
}

func (c *cachingConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	cs, err := c.stmt(ctx, query)
	if err != nil {
		return nil, err
	}
	if !c.inTx {
		// A write outside a transaction takes the write lock too.
		defer c.gate.enter(ctx)()
	}
	if cs == nil {
		return c.inner().ExecContext(ctx, query, args)
	}
	return cs.s.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (c *cachingConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	cs, err := c.stmt(ctx, query)
	if err != nil {
		return nil, err
	}
	if cs == nil {
		return c.inner().QueryContext(ctx, query, args)
	}
	rows, err := cs.s.(driver.StmtQueryContext).QueryContext(ctx, args)
	if err != nil {
		return nil, err
	}
	cs.busy = true
	return &cachedRows{Rows: rows, stmt: cs}, nil
}

func (c *cachingConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	return c.inner().PrepareContext(ctx, query)
}

// BeginTx opens a transaction; one that may write (BEGIN IMMEDIATE takes
// SQLite's write lock) first passes the write gate.
func (c *cachingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	leave := func() {}
	if !opts.ReadOnly {
		leave = c.gate.enter(ctx)
		if err := ctx.Err(); err != nil {
			leave()
			return nil, err
		}
	}
	tx, err := c.inner().BeginTx(ctx, opts)
	if err != nil {
		leave()
		return nil, err
	}
	gt := &gatedTx{Tx: tx, end: func() { c.inTx = false; leave() }}
	c.inTx, c.endTx = true, gt.done
	return gt, nil
}

func (c *cachingConn) Ping(ctx context.Context) error { return c.inner().Ping(ctx) }

func (c *cachingConn) ResetSession(ctx context.Context) error { return c.inner().ResetSession(ctx) }

func (c *cachingConn) IsValid() bool { return c.inner().IsValid() }

// Close finalizes the cached statements, then closes the connection (and
// leaves the gate, should a transaction still be open on it).
func (c *cachingConn) Close() error {
	if c.inTx {
		c.endTx()
	}
	for q, cs := range c.stmts {
		_ = cs.s.Close()
		delete(c.stmts, q)
	}
	return c.Conn.Close()
}

// cachedRows gives its statement back when closed; its column types come
// from the driver's rows.
type cachedRows struct {
	driver.Rows
	stmt *cachedStmt
}

func (r *cachedRows) Close() error {
	err := r.Rows.Close()
	r.stmt.busy = false
	return err
}

func (r *cachedRows) ColumnTypeScanType(i int) reflect.Type {
	if t, ok := r.Rows.(driver.RowsColumnTypeScanType); ok {
		return t.ColumnTypeScanType(i)
	}
	return reflect.TypeFor[any]()
}

func (r *cachedRows) ColumnTypeDatabaseTypeName(i int) string {
	if t, ok := r.Rows.(driver.RowsColumnTypeDatabaseTypeName); ok {
		return t.ColumnTypeDatabaseTypeName(i)
	}
	return ""
}

func (r *cachedRows) ColumnTypeNullable(i int) (nullable, ok bool) {
	if t, ok := r.Rows.(driver.RowsColumnTypeNullable); ok {
		return t.ColumnTypeNullable(i)
	}
	return false, false
}

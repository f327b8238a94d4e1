package sqlite

import (
	"context"
	"database/sql/driver"
	"time"
)

// The write gate. SQLite lets one writer in at a time; a second one that
// finds the lock taken waits in SQLite's busy handler, which sleeps 1, 2,
// 5, 10, 15 ms and longer between tries whatever the holder does: under
// two concurrent writers, most of a request's added latency. This
// process's writers queue at the gate instead, and the next goes in as
// soon as the one before commits. SQLite's lock and busy_timeout stay for
// anyone else (another process, the kvgate CLI on the same file).
//
// A writer waits at the gate at most gateWait, then goes on without it,
// so that a transaction that (wrongly) waits on another one fails under
// SQLite's busy_timeout as it would without the gate, instead of hanging.
const gateWait = 10 * time.Second // the DSN's busy_timeout

type writeGate struct{ ch chan struct{} }

func newWriteGate() *writeGate { return &writeGate{ch: make(chan struct{}, 1)} }

// enter waits for the gate (or ctx's end, or gateWait) and returns the
// function that leaves it; that function does nothing when the gate was
// not entered.
func (g *writeGate) enter(ctx context.Context) (leave func()) {
	select {
	case g.ch <- struct{}{}:
		return g.leave
	default:
	}
	t := time.NewTimer(gateWait)
	defer t.Stop()
	select {
	case g.ch <- struct{}{}:
		return g.leave
	case <-ctx.Done():
	case <-t.C:
	}
	return func() {}
}

func (g *writeGate) leave() { <-g.ch }

// gatedTx leaves the gate when it ends, once.
type gatedTx struct {
	driver.Tx
	end   func()
	ended bool
}

func (t *gatedTx) Commit() error {
	err := t.Tx.Commit()
	t.done()
	return err
}

func (t *gatedTx) Rollback() error {
	err := t.Tx.Rollback()
	t.done()
	return err
}

func (t *gatedTx) done() {
	if !t.ended {
		t.ended = true
		t.end()
	}
}

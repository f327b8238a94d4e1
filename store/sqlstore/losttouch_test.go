package sqlstore

import (
	"errors"
	"net"
	"syscall"
	"testing"

	"github.com/kvgate/kvgate/store"
)

// TestLostTouchSeesTheDriverError: a connection lost in flight is, once
// the store has named it unavailable, still a lost touch: its outcome is
// unknown, so an acquisition it may have committed is undone
// (undoAcquire), and the calls of its batch are not tried again one by
// one. The wrapping used to keep the driver's error as text alone.
func TestLostTouchSeesTheDriverError(t *testing.T) {
	s := &Store{d: Dialect{Unavailable: func(err error) bool {
		var ne net.Error
		return errors.As(err, &ne)
	}}}
	lost := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	err := s.err("acquire", lost)
	if !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("%v: want ErrUnavailable", err)
	}
	var ne net.Error
	if !errors.As(err, &ne) {
		t.Errorf("%v: the driver's error is gone from the chain", err)
	}
	if !s.lostTouch(err) {
		t.Errorf("%v: not a lost touch", err)
	}
	if s.lostTouch(s.err("acquire", errors.New("duplicate key"))) {
		t.Error("a statement the database refused is a lost touch")
	}
}

// TestStoreFailureIsNamed: a statement the database reached and failed
// (a value it refuses, a full disk) carries ErrFailed, beside the
// driver's error: kvgate's own failure, which the gateway answers as
// such rather than as a backend's.
func TestStoreFailureIsNamed(t *testing.T) {
	s := &Store{d: Dialect{Unavailable: func(error) bool { return false }}}
	refused := errors.New(`invalid byte sequence for encoding "UTF8": 0x00`)
	err := s.err("create file", refused)
	if !errors.Is(err, store.ErrFailed) || !errors.Is(err, refused) || errors.Is(err, store.ErrUnavailable) {
		t.Errorf("%v: want ErrFailed and the driver's error, not ErrUnavailable", err)
	}
}

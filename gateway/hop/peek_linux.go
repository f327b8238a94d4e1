package hop

import (
	"net"
	"syscall"
)

const peekable = true

// alive peeks at an idle connection without waiting: a live one has
// nothing to read (EAGAIN); one the backend closed reads end of file,
// and one with bytes on it is out of step. Either of those is dropped.
func alive(nc net.Conn) bool {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	live := false
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, perr := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		live = perr == syscall.EAGAIN
		return true
	})
	return err == nil && live
}

package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// lockFile is the file in the data directory whose lock says that a
// kvgate process uses the directory; it holds that process's pid.
const lockFile = "kvgate.lock"

// lockDataDir takes the data directory for this process alone: an
// exclusive flock on its lock file, so that a second kvgate never runs a
// second embedded store or JetStream server on the same files. Closing
// the returned file releases the lock; so does the process's end, a crash
// or a kill -9 too, since the kernel drops the lock with the file. When
// another process holds it, the error names its pid.
func lockDataDir(dir string) (io.Closer, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("data directory: %w", err)
	}
	path := filepath.Join(dir, lockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("data directory lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b, _ := io.ReadAll(io.LimitReader(f, 32))
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			holder := "unknown"
			if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); perr == nil {
				holder = strconv.Itoa(pid)
			}
			return nil, fmt.Errorf("data directory %s is in use by another kvgate (pid %s, lock %s): "+
				"two gateways must not share one data directory; stop that one, or give this one its own --data-dir", dir, holder, path)
		}
		return nil, fmt.Errorf("lock data directory %s: %w", dir, err)
	}
	// The pid is for the message above only: the lock is the flock.
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return f, nil
}

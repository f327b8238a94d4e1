package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// progress shows a run's progress: a bar redrawn in place on a terminal,
// a plain line every five seconds otherwise. A nil writer shows nothing.
type progress struct {
	w        io.Writer
	tty      bool
	sentN    atomic.Int64
	doneN    atomic.Int64
	failedN  atomic.Int64
	mu       sync.Mutex
	point    int
	total    int
	duration time.Duration
	start    time.Time
	stopc    chan struct{}
	wg       sync.WaitGroup
}

func newProgress(w io.Writer) *progress {
	if w == nil {
		return nil
	}
	p := &progress{w: w, tty: isTerminal(w), stopc: make(chan struct{})}
	every := 5 * time.Second
	if p.tty {
		every = 200 * time.Millisecond
	}
	p.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-p.stopc:
				return
			case <-t.C:
				p.draw(false)
			}
		}
	})
	return p
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func (p *progress) startPoint(i, total int, d time.Duration) {
	if p == nil {
		return
	}
	p.mu.Lock()
	if p.start != (time.Time{}) {
		p.mu.Unlock()
		p.draw(true)
		p.mu.Lock()
	}
	p.point, p.total, p.duration, p.start = i, total, d, time.Now()
	p.sentN.Store(0)
	p.doneN.Store(0)
	p.failedN.Store(0)
	p.mu.Unlock()
}

func (p *progress) sent() {
	if p != nil {
		p.sentN.Add(1)
	}
}

func (p *progress) done(failed bool) {
	if p == nil {
		return
	}
	p.doneN.Add(1)
	if failed {
		p.failedN.Add(1)
	}
}

func (p *progress) draw(final bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.start == (time.Time{}) {
		return
	}
	el := time.Since(p.start)
	done, failed, sent := p.doneN.Load(), p.failedN.Load(), p.sentN.Load()
	frac := -1.0
	switch {
	case p.total > 0:
		frac = float64(done) / float64(p.total)
	case p.duration > 0:
		frac = min(1, el.Seconds()/p.duration.Seconds())
	}
	rate := float64(done) / max(el.Seconds(), 1e-9)
	line := fmt.Sprintf("point %d: %d done (%d failed), %d in flight, %.1f req/s, %s", p.point, done, failed, sent-done, rate, el.Truncate(100*time.Millisecond))
	if !p.tty {
		fmt.Fprintln(p.w, line)
		return
	}
	bar := ""
	if frac >= 0 {
		n := int(frac * 30)
		bar = fmt.Sprintf("[%s%s] %3.0f%% ", strings.Repeat("=", n), strings.Repeat(" ", 30-n), 100*frac)
	}
	end := ""
	if final {
		end = "\n"
	}
	fmt.Fprintf(p.w, "\r\033[K%s%s%s", bar, line, end)
}

func (p *progress) finish() {
	if p == nil {
		return
	}
	close(p.stopc)
	p.wg.Wait()
	p.draw(true)
}

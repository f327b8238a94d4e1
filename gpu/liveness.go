package gpu

import (
	"context"
	"errors"
	"net"
	"time"
)

// A probe or scrape that times out on a busy host says little about the
// backend: the request may have sat in kvgate's own run queue, or the
// backend's, for the whole timeout. What kvgate's own traffic saw says
// more. A backend that completed a dispatch for kvgate after the probe or
// scrape was sent is answering: its timed-out probe does not count towards
// ejection, and its timed-out scrape does not mark the metrics failed, so
// that admission goes on from a late view (the last scrape, what kvgate
// sent and heard since, with the late margin) until the metrics are older
// than twice the staleness bound, when the backend counts as saturated as
// before. A backend that stops answering kvgate too is ejected by its
// probes and goes stale as it always did; one that refuses connections or
// answers errors fails at once, timeouts or not.

// noteAnswer records that the backend completed a dispatch now.
func (b *backend) noteAnswer(now time.Time) { b.lastAnswer.Store(now.UnixNano()) }

// answeredSince reports whether the backend completed a dispatch at or
// after t.
func (b *backend) answeredSince(t time.Time) bool {
	last := b.lastAnswer.Load()
	return last != 0 && last >= t.UnixNano()
}

// timedOut reports whether err is a timeout (the request's deadline, or
// the connection's), not a refusal or an error answer.
func timedOut(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// excused reports whether a probe or scrape of b sent at sent and failed
// with err is put down to a busy host rather than to the backend: it timed
// out, and the backend has answered kvgate's own traffic since.
func (b *backend) excused(err error, sent time.Time) bool {
	return err != nil && timedOut(err) && b.answeredSince(sent)
}

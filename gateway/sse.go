package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Job event streams (Server-Sent Events).
//
// GET /v1/jobs/{id}/events follows one job; GET /v1/events follows every
// job of the caller's tenant. Each event's id is its place in the store's
// published feed, which follows commit order, so a client that reconnects
// with Last-Event-ID gets exactly what it missed. Without one, or with one
// too far behind (more than Jobs.MaxReplay events), the stream starts with a
// fresh snapshot instead. A job stream ends after the job's final state.
//
// Per job, state_version never goes backwards, across reconnects too. A
// job's events reach the feed in the order they were committed, which is
// the order of their state_versions; so what could take a client back is a
// snapshot showing a state whose events still wait in the outbox, with an
// id that places it before them. Each stream rules that out its own way,
// with no memory that grows with the jobs it has shown:
//   - The tenant's snapshot shows each job as the feed shows it at the
//     snapshot's place (a job the feed does not know yet is left out): every
//     event after that place is newer than what the snapshot showed.
//   - A job's snapshot shows the job's row, which may be ahead of the feed,
//     and its id says so: "place.version", the feed place and the
//     state_version shown. Resuming from it, the stream skips events up to
//     that version. An event's id is its place alone: the client was last
//     shown that event's state, and the feed after it holds only newer ones.

const (
	feedPage     = 500              // events read at once
	feedRecheck  = time.Second      // store read period when no notice comes
	sseKeepalive = 15 * time.Second // comment line that keeps proxies from closing an idle stream
	// followGap is the least time between two reads of one stream woken
	// by notices: a busy tenant's relay publishes a batch every few
	// milliseconds, and each of its open streams would read the store as
	// often. The notices in between are read together.
	followGap    = 50 * time.Millisecond
	snapshotJobs = 100 // jobs in a tenant stream's snapshot
)

type eventView struct {
	ID           string `json:"id"`
	Object       string `json:"object"`
	Type         string `json:"type"`
	JobID        string `json:"job_id"`
	State        string `json:"state"`
	StateVersion int64  `json:"state_version"`
	CreatedAt    int64  `json:"created_at"`
}

// sseWriter writes events and flushes each. Each write has idle to
// finish: a client that stops reading (its connection open, its window
// shut) is let go of then, as a proxied stream's is (clientWrites), not
// held, with its goroutine, until the drain closes it.
type sseWriter struct {
	w    http.ResponseWriter
	rc   *http.ResponseController
	idle time.Duration
}

// due gives the next write idle to finish.
func (e *sseWriter) due() {
	_ = e.rc.SetWriteDeadline(time.Now().Add(e.idle)) // ErrNotSupported: no deadline
}

// flush sends what was written and lifts the write's deadline: it bounds
// a write in progress, not the quiet between events. Left standing, it
// would end an idle stream once it passed (over HTTP/2 a passed deadline
// resets the stream, and a later one cannot revive it) whenever idle is
// shorter than the keepalive.
func (e *sseWriter) flush() error {
	if err := e.rc.Flush(); err != nil {
		return err
	}
	_ = e.rc.SetWriteDeadline(time.Time{})
	return nil
}

func (e *sseWriter) send(id, event string, data any) error {
	b, err := json.Marshal(data)
	if err != nil {
		return err
	}
	e.due()
	if _, err := fmt.Fprintf(e.w, "id: %s\nevent: %s\ndata: %s\n\n", id, event, b); err != nil {
		return err
	}
	return e.flush()
}

// fail ends a stream with an error event in OpenAI's error shape. It
// carries no id, so that the client's Last-Event-ID stays the last event
// it was sent.
func (e *sseWriter) fail(err error) {
	b, merr := json.Marshal(toAPIError(err).body())
	if merr != nil {
		return
	}
	e.due()
	if _, err := fmt.Fprintf(e.w, "event: error\ndata: %s\n\n", b); err == nil {
		_ = e.rc.Flush()
	}
}

func (e *sseWriter) comment(text string) error {
	e.due()
	if _, err := fmt.Fprintf(e.w, ": %s\n\n", text); err != nil {
		return err
	}
	return e.flush()
}

// startSSE begins an event stream whose writes have idle each to finish.
// The stream outlives the server's write timeout: each write sets its own
// deadline.
func startSSE(w http.ResponseWriter, idle time.Duration) (*sseWriter, error) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	e := &sseWriter{w: w, rc: http.NewResponseController(w), idle: idle}
	e.due()
	w.WriteHeader(http.StatusOK)
	return e, e.flush()
}

// place is where a client stands on a stream: after the feed place after
// and, on a job's stream, having been shown the job at state_version
// shown (0: whatever the event at that place showed).
type place struct {
	after, shown int64
}

// id is the place as an event's id: "after", or "after.shown".
func (p place) id() string {
	if p.shown == 0 {
		return strconv.FormatInt(p.after, 10)
	}
	return strconv.FormatInt(p.after, 10) + "." + strconv.FormatInt(p.shown, 10)
}

// lastEventID returns the client's place: the Last-Event-ID header, or
// the after query parameter for clients that cannot set headers.
func lastEventID(r *http.Request) (place, bool, error) {
	v := r.Header.Get("Last-Event-ID")
	if v == "" {
		v = r.URL.Query().Get("after")
	}
	if v == "" {
		return place{}, false, nil
	}
	bad := badRequest("Last-Event-ID", "Last-Event-ID must be the id of an event this stream sent.")
	a, sv, versioned := strings.Cut(v, ".")
	p := place{}
	var err error
	if p.after, err = strconv.ParseInt(a, 10, 64); err != nil || p.after < 0 {
		return place{}, false, bad
	}
	if versioned {
		if p.shown, err = strconv.ParseInt(sv, 10, 64); err != nil || p.shown < 1 {
			return place{}, false, bad
		}
	}
	return p, true, nil
}

// streamEnds reports whether a job's stream ends once it has shown the
// state: a final state, but for REVIEW_REQUIRED, whose next step, a
// reviewer's decision, the client waits for as it waits for a run. A
// replay of a final job is a person starting it over: a new stream
// follows it.
func streamEnds(st store.State) bool { return st.Final() && st != store.ReviewRequired }

func (s *Server) handleJobEvents(w http.ResponseWriter, r *http.Request) int {
	ctx, tenant, id := r.Context(), tenantOf(r.Context()), r.PathValue("id")
	at, resume, err := lastEventID(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	if resume {
		// As on the tenant's stream: a cursor the feed never reached (a
		// client bug, another deployment's, a restored database) starts
		// afresh rather than wait below events it would never see.
		head, err := s.jobs.Store.FeedHead(ctx, tenant)
		if err != nil {
			return writeError(w, s.log, err)
		}
		if at.after > head {
			at, resume = place{}, false
		}
	}
	if !resume {
		// The snapshot's place: the job's latest published event, read
		// before the job itself, so that an event published in between
		// comes after it (and, not newer than the snapshot, is skipped)
		// rather than before it, unsent.
		e, found, err := s.lastEventUpTo(ctx, tenant, id, math.MaxInt64)
		if err != nil {
			return writeError(w, s.log, err)
		}
		if found {
			at.after = e.Cursor
		}
	}
	j, err := s.jobs.Store.Get(ctx, tenant, id)
	if err != nil {
		return writeError(w, s.log, err)
	}
	if resume && at.shown == 0 {
		// A store that cannot say what the client was shown fails the
		// request: taking it for nothing would show the client states
		// it has seen, its last among them, again.
		if at.shown, err = s.versionAt(ctx, tenant, id, at.after); err != nil {
			return writeError(w, s.log, err)
		}
	}
	shown := at.shown // the state_version the client has seen
	if resume && streamEnds(j.State) && j.StateVersion <= shown {
		// The client has seen the end already. 204, not an empty
		// stream: a browser's EventSource reconnects after a stream
		// that ends, and stops only on 204.
		w.WriteHeader(http.StatusNoContent)
		return http.StatusNoContent
	}
	sse, err := startSSE(w, s.cfg.StreamIdleTimeout)
	if err != nil {
		return http.StatusOK
	}
	if !resume {
		if sse.send(place{at.after, j.StateVersion}.id(), "snapshot", viewOf(j)) != nil || streamEnds(j.State) {
			return http.StatusOK
		}
		shown = j.StateVersion
	}
	keep := func(e store.Event) (bool, bool) {
		if e.StateVersion <= shown {
			return false, false
		}
		shown = e.StateVersion
		return true, streamEnds(e.State)
	}
	// The job's row is the truth: on each recheck, a state the feed has
	// not shown yet (its events wait for the broker) goes out as a fresh
	// snapshot, so that the stream reaches the final state even while
	// events are not being published. Its id carries the version shown.
	recheck := func(after int64) (bool, error) {
		j, err := s.jobs.Store.Get(ctx, tenant, id)
		if err != nil {
			return false, err
		}
		if j.StateVersion <= shown {
			return streamEnds(j.State), nil // nothing new; the end if it was shown
		}
		shown = j.StateVersion
		if err := sse.send(place{after, shown}.id(), "snapshot", viewOf(j)); err != nil {
			return true, err
		}
		return streamEnds(j.State), nil
	}
	s.follow(r, sse, id, at.after, keep, recheck)
	return http.StatusOK
}

// versionAt returns the state_version of a job's event at a feed place,
// or 0 when the place is not one of the job's events.
func (s *Server) versionAt(ctx context.Context, tenant, jobID string, at int64) (int64, error) {
	if at < 1 {
		return 0, nil
	}
	evs, err := s.jobs.Store.Events(ctx, tenant, jobID, at-1, 1)
	if err != nil {
		return 0, err
	}
	if len(evs) == 0 || evs[0].Cursor != at {
		return 0, nil
	}
	return evs[0].StateVersion, nil
}

// lastEventUpTo returns a job's latest published event at or before a feed
// place; found is false when the feed holds none.
func (s *Server) lastEventUpTo(ctx context.Context, tenant, jobID string, upTo int64) (last store.Event, found bool, err error) {
	for after := int64(0); ; {
		evs, err := s.jobs.Store.Events(ctx, tenant, jobID, after, feedPage)
		if err != nil {
			return store.Event{}, false, err
		}
		for _, e := range evs {
			if e.Cursor > upTo {
				return last, found, nil
			}
			last, found, after = e, true, e.Cursor
		}
		if len(evs) < feedPage {
			return last, found, nil
		}
	}
}

func (s *Server) handleTenantEvents(w http.ResponseWriter, r *http.Request) int {
	ctx, tenant := r.Context(), tenantOf(r.Context())
	at, resume, err := lastEventID(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	if at.shown != 0 {
		// A job stream's id: it places nothing on the tenant's stream.
		return writeError(w, s.log, badRequest("Last-Event-ID", "Last-Event-ID must be the id of an event this stream sent."))
	}
	head, err := s.jobs.Store.FeedHead(ctx, tenant)
	if err != nil {
		return writeError(w, s.log, err)
	}
	// A cursor the feed never reached is a client bug or another
	// deployment's: start afresh rather than wait for it.
	if resume && (at.after > head || s.behind(ctx, tenant, at.after)) {
		resume = false
	}
	sse, err := startSSE(w, s.cfg.StreamIdleTimeout)
	if err != nil {
		return http.StatusOK
	}
	if !resume {
		if s.sendSnapshot(ctx, sse, tenant, head) != nil {
			return http.StatusOK
		}
		at.after = head
	}
	// No event after the snapshot's place is older than what it showed,
	// and the feed keeps each job's versions rising: nothing to skip.
	s.follow(r, sse, "", at.after, func(store.Event) (bool, bool) { return true, false }, nil)
	return http.StatusOK
}

// behind reports whether more than MaxReplay of the tenant's events lie
// after the cursor.
func (s *Server) behind(ctx context.Context, tenant string, after int64) bool {
	n, err := s.jobs.Store.CountEvents(ctx, tenant, after, s.jobs.MaxReplay+1)
	return err == nil && n > s.jobs.MaxReplay
}

// sendSnapshot sends the tenant's latest jobs as one snapshot event whose
// id is the feed place head, each job as the feed shows it there: its
// state of its latest event up to head, and not at all without one. A
// state newer than that (its event waits in the outbox) comes as an event
// after head.
func (s *Server) sendSnapshot(ctx context.Context, sse *sseWriter, tenant string, head int64) error {
	jobs, _, err := s.jobs.Store.List(ctx, tenant, store.ListFilter{Limit: snapshotJobs})
	if err != nil {
		return err
	}
	snap := struct {
		Object string    `json:"object"`
		Cursor int64     `json:"cursor"`
		Data   []jobView `json:"data"`
	}{Object: "snapshot", Cursor: head, Data: make([]jobView, 0, len(jobs))}
	for _, j := range jobs {
		e, found, err := s.lastEventUpTo(ctx, tenant, j.ID, head)
		if err != nil {
			return err
		}
		if !found {
			continue
		}
		j.State, j.StateVersion, j.UpdatedAt = e.State, e.StateVersion, e.CreatedAt
		snap.Data = append(snap.Data, viewOf(j))
	}
	return sse.send(place{after: head}.id(), "snapshot", snap)
}

// follow sends the caller's feed (one job's, with jobID) after the cursor
// as it is published, until the client leaves, keep says the stream is
// done, or the store fails (the client reconnects with its Last-Event-ID).
// keep decides per event whether to send it and whether it ends the
// stream; recheck, when set, runs on every periodic look and may end the
// stream too. Each look also checks the caller's key again, as a new
// request would be checked: a stream whose key was revoked ends with an
// error event within the key cache's TTL and a second. A drain ends the
// stream at once, with an error event that says to reconnect.
func (s *Server) follow(r *http.Request, sse *sseWriter, jobID string, after int64,
	keep func(store.Event) (send, last bool), recheck func(cursor int64) (last bool, err error)) {
	ctx, tenant := r.Context(), tenantOf(r.Context())
	tick := time.NewTicker(feedRecheck)
	defer tick.Stop()
	lastWrite := time.Now()
	var gap *time.Timer // the rest of followGap after a notice
	defer func() {
		if gap != nil {
			gap.Stop()
		}
	}()
	for {
		// Take the notice channel before reading, so that a notice that
		// comes during the read is not missed.
		var changed <-chan struct{}
		if s.jobs.Feed != nil {
			changed = s.jobs.Feed.Changed(tenant)
		}
		read := time.Now()
		for {
			evs, err := s.jobs.Store.Events(ctx, tenant, jobID, after, feedPage)
			if err != nil {
				if !errors.Is(err, context.Canceled) {
					s.log.Warn("event stream read failed", "tenant", tenant, "err", err)
				}
				return
			}
			for _, e := range evs {
				after = e.Cursor
				send, last := keep(e)
				if !send {
					continue
				}
				v := eventView{ID: e.ID, Object: "job.event", Type: e.Type, JobID: e.JobID, State: string(e.State),
					StateVersion: e.StateVersion, CreatedAt: e.CreatedAt.Unix()}
				if sse.send(place{after: e.Cursor}.id(), e.Type, v) != nil || last {
					return
				}
				lastWrite = time.Now()
			}
			if len(evs) < feedPage {
				break
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-s.drain.begun:
			sse.fail(errStreamDrained)
			return
		case <-changed:
			if wait := followGap - time.Since(read); wait > 0 {
				if gap == nil {
					gap = time.NewTimer(wait)
				} else {
					gap.Reset(wait)
				}
				select {
				case <-ctx.Done():
					return
				case <-s.drain.begun:
					sse.fail(errStreamDrained)
					return
				case <-gap.C:
				}
			}
		case <-tick.C:
			if err := s.reauthorize(r); err != nil {
				if ctx.Err() == nil {
					sse.fail(err)
				}
				return
			}
			if recheck != nil {
				if last, err := recheck(after); last || err != nil {
					return
				}
			}
			if time.Since(lastWrite) >= sseKeepalive {
				if sse.comment("keepalive") != nil {
					return
				}
				lastWrite = time.Now()
			}
		}
	}
}

// reauthorize checks a stream's caller again, as a new request would be
// checked: a key revoked since the stream began, or one that now names
// another tenant, no longer passes. Static keys live as long as the
// process, so without a key store there is nothing to check.
func (s *Server) reauthorize(r *http.Request) error {
	if s.keys == nil {
		return nil
	}
	p, err := s.authenticate(r)
	if err != nil {
		return err
	}
	// The stream's tenant as the request chose it: an admin's read of
	// another tenant (?tenant=) is as allowed now as when it began.
	if readScope(r, p) != tenantOf(r.Context()) {
		return &apiError{status: http.StatusUnauthorized, typ: "invalid_request_error", code: "invalid_api_key",
			msg: "The API key this stream was opened with no longer gives access to its tenant."}
	}
	return nil
}

// attemptView is one attempt as an operator sees it.
type attemptView struct {
	Attempt int    `json:"attempt"`
	Fence   int64  `json:"fence"`
	Backend string `json:"backend"`
	Outcome string `json:"outcome"`
	// Spent: the attempt counted against the job's attempts; Sent: its
	// request may have reached a backend.
	Spent            bool   `json:"spent"`
	Sent             bool   `json:"sent"`
	ErrorClass       string `json:"error_class,omitempty"`
	Error            string `json:"error,omitempty"`
	PromptTokens     int    `json:"prompt_tokens"`
	CompletionTokens int    `json:"completion_tokens"`
	StartedAt        int64  `json:"started_at,omitempty"` // unknown (0) for a lease the reaper took
	EndedAt          int64  `json:"ended_at"`
	// The policy version this attempt's validation judged by (outcomes.go).
	Policy        string `json:"policy,omitempty"`
	PolicyVersion int    `json:"policy_version,omitempty"`
}

// handleJobAttempts lists a job's attempts: backends, outcomes and error
// classes. Operators only: another tenant's job is still a 404.
func (s *Server) handleJobAttempts(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	j, err := s.jobs.Store.Get(ctx, tenantOf(ctx), r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, err)
	}
	if !isOperator(ctx) {
		return writeError(w, s.log, forbidden("operator_key_required", "A job's attempts and retry details need an operator key for its tenant."))
	}
	as, err := s.jobs.Store.Attempts(ctx, j.ID)
	if err != nil {
		return writeError(w, s.log, err)
	}
	out := struct {
		Object     string        `json:"object"`
		JobID      string        `json:"job_id"`
		Attempt    int           `json:"attempt"`
		ErrorClass string        `json:"error_class,omitempty"`
		LastError  string        `json:"last_error,omitempty"`
		Data       []attemptView `json:"data"`
	}{Object: "list", JobID: j.ID, Attempt: j.Attempt, ErrorClass: j.ErrorClass, LastError: j.LastError, Data: make([]attemptView, len(as))}
	for i, a := range as {
		out.Data[i] = attemptView{Attempt: a.Attempt, Fence: a.Fence, Backend: a.Backend, Outcome: a.Outcome, Spent: a.Spent, Sent: a.Sent,
			ErrorClass: a.ErrorClass, Error: a.Error, PromptTokens: a.PromptTokens, CompletionTokens: a.CompletionTokens,
			EndedAt: a.EndedAt.Unix()}
		if !a.StartedAt.IsZero() {
			out.Data[i].StartedAt = a.StartedAt.Unix()
		}
	}
	s.attemptPolicies(ctx, j.ID, out.Data)
	writeJSON(w, http.StatusOK, out)
	return http.StatusOK
}

package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
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
// fresh snapshot instead. Per job, state_version never goes backwards: an
// event older than what the client was already shown is skipped. A job
// stream ends after the job's final state.

const (
	feedPage      = 500              // events read at once
	feedRecheck   = time.Second      // store read period when no notice comes
	sseKeepalive  = 15 * time.Second // comment line that keeps proxies from closing an idle stream
	snapshotJobs  = 100              // jobs in a tenant stream's snapshot
	maxSSEJobSeen = 100_000          // jobs whose last state_version a tenant stream remembers
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

// sseWriter writes events and flushes each.
type sseWriter struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func (e *sseWriter) send(id int64, event string, data any) error {
	b, err := json.Marshal(data)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(e.w, "id: %d\nevent: %s\ndata: %s\n\n", id, event, b); err != nil {
		return err
	}
	return e.rc.Flush()
}

func (e *sseWriter) comment(text string) error {
	if _, err := fmt.Fprintf(e.w, ": %s\n\n", text); err != nil {
		return err
	}
	return e.rc.Flush()
}

func startSSE(w http.ResponseWriter) (*sseWriter, error) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	e := &sseWriter{w: w, rc: http.NewResponseController(w)}
	// Streams outlive the server's write timeout.
	_ = e.rc.SetWriteDeadline(time.Time{})
	return e, e.rc.Flush()
}

// lastEventID returns the client's cursor: the Last-Event-ID header, or
// the after query parameter for clients that cannot set headers.
func lastEventID(r *http.Request) (int64, bool, error) {
	v := r.Header.Get("Last-Event-ID")
	if v == "" {
		v = r.URL.Query().Get("after")
	}
	if v == "" {
		return 0, false, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, false, badRequest("Last-Event-ID", "Last-Event-ID must be the id of an event this stream sent.")
	}
	return n, true, nil
}

func (s *Server) handleJobEvents(w http.ResponseWriter, r *http.Request) int {
	tenant, id := tenantOf(r.Context()), r.PathValue("id")
	after, resume, err := lastEventID(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	if !resume {
		// The snapshot's id: the job's latest published event, read
		// before the job itself, so that an event published in between
		// comes after the cursor (and, not being newer than the snapshot,
		// is skipped) rather than before it, unsent.
		evs, err := s.jobs.Store.Events(r.Context(), tenant, id, 0, 1000)
		if err != nil {
			return writeError(w, s.log, err)
		}
		if len(evs) > 0 {
			after = evs[len(evs)-1].Cursor
		}
	}
	j, err := s.jobs.Store.Get(r.Context(), tenant, id)
	if err != nil {
		return writeError(w, s.log, err)
	}
	var shown int64 // the state_version the client has seen
	sse, err := startSSE(w)
	if err != nil {
		return http.StatusOK
	}
	if !resume {
		if sse.send(after, "snapshot", viewOf(j)) != nil || j.State.Final() {
			return http.StatusOK
		}
		shown = j.StateVersion
	}
	keep := func(e store.Event) (bool, bool) {
		if e.StateVersion <= shown {
			return false, false
		}
		shown = e.StateVersion
		return true, e.State.Final()
	}
	// The job's row is the truth: on each recheck, a state the feed has
	// not shown yet (its events wait for the broker) goes out as a fresh
	// snapshot, so that the stream reaches the final state even while
	// events are not being published.
	recheck := func(cursor int64) (bool, error) {
		j, err := s.jobs.Store.Get(r.Context(), tenant, id)
		if err != nil || j.StateVersion <= shown {
			return false, err
		}
		shown = j.StateVersion
		if err := sse.send(cursor, "snapshot", viewOf(j)); err != nil {
			return true, err
		}
		return j.State.Final(), nil
	}
	s.follow(r.Context(), sse, tenant, id, after, keep, recheck)
	return http.StatusOK
}

func (s *Server) handleTenantEvents(w http.ResponseWriter, r *http.Request) int {
	ctx, tenant := r.Context(), tenantOf(r.Context())
	after, resume, err := lastEventID(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	head, err := s.jobs.Store.FeedHead(ctx, tenant)
	if err != nil {
		return writeError(w, s.log, err)
	}
	// A cursor the feed never reached is a client bug or another
	// deployment's: start afresh rather than wait for it.
	if resume && (after > head || s.behind(ctx, tenant, after)) {
		resume = false
	}
	sse, err := startSSE(w)
	if err != nil {
		return http.StatusOK
	}
	shown := map[string]int64{}
	if !resume {
		// The snapshot may already show states whose events come after
		// head: those events must not take a job back.
		jobs, err := s.sendSnapshot(ctx, sse, tenant, head)
		if err != nil {
			return http.StatusOK
		}
		for _, j := range jobs {
			shown[j.ID] = j.StateVersion
		}
		after = head
	}
	s.follow(ctx, sse, tenant, "", after, func(e store.Event) (bool, bool) {
		if e.StateVersion <= shown[e.JobID] {
			return false, false
		}
		if len(shown) >= maxSSEJobSeen {
			clear(shown) // bounded memory; the feed's order keeps versions rising anyway
		}
		shown[e.JobID] = e.StateVersion
		return true, false
	}, nil)
	return http.StatusOK
}

// behind reports whether more than MaxReplay of the tenant's events lie
// after the cursor.
func (s *Server) behind(ctx context.Context, tenant string, after int64) bool {
	evs, err := s.jobs.Store.Events(ctx, tenant, "", after, s.jobs.MaxReplay+1)
	return err == nil && len(evs) > s.jobs.MaxReplay
}

// sendSnapshot sends the tenant's latest jobs as one snapshot event whose
// id is the feed's head.
func (s *Server) sendSnapshot(ctx context.Context, sse *sseWriter, tenant string, head int64) ([]store.Job, error) {
	jobs, _, err := s.jobs.Store.List(ctx, tenant, store.ListFilter{Limit: snapshotJobs})
	if err != nil {
		return nil, err
	}
	snap := struct {
		Object string    `json:"object"`
		Cursor int64     `json:"cursor"`
		Data   []jobView `json:"data"`
	}{Object: "snapshot", Cursor: head, Data: make([]jobView, len(jobs))}
	for i, j := range jobs {
		snap.Data[i] = viewOf(j)
	}
	return jobs, sse.send(head, "snapshot", snap)
}

// follow sends the feed's events after the cursor as they are published,
// until the client leaves, keep says the stream is done, or the store
// fails (the client reconnects with its Last-Event-ID). keep decides per
// event whether to send it and whether it ends the stream; recheck, when
// set, runs on every periodic look and may end the stream too.
func (s *Server) follow(ctx context.Context, sse *sseWriter, tenant, jobID string, after int64,
	keep func(store.Event) (send, last bool), recheck func(cursor int64) (last bool, err error)) {
	tick := time.NewTicker(feedRecheck)
	defer tick.Stop()
	lastWrite := time.Now()
	for {
		// Take the notice channel before reading, so that a notice that
		// comes during the read is not missed.
		var changed <-chan struct{}
		if s.jobs.Feed != nil {
			changed = s.jobs.Feed.Changed()
		}
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
				if sse.send(e.Cursor, e.Type, v) != nil || last {
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
		case <-changed:
		case <-tick.C:
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

// attemptView is one attempt as an operator sees it.
type attemptView struct {
	Attempt          int    `json:"attempt"`
	Fence            int64  `json:"fence"`
	Backend          string `json:"backend"`
	Outcome          string `json:"outcome"`
	ErrorClass       string `json:"error_class,omitempty"`
	Error            string `json:"error,omitempty"`
	PromptTokens     int    `json:"prompt_tokens"`
	CompletionTokens int    `json:"completion_tokens"`
	StartedAt        int64  `json:"started_at"`
	EndedAt          int64  `json:"ended_at"`
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
		return writeError(w, s.log, &apiError{status: http.StatusForbidden, typ: "invalid_request_error", code: "operator_key_required",
			msg: "A job's attempts and retry details need an operator key for its tenant."})
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
		out.Data[i] = attemptView{Attempt: a.Attempt, Fence: a.Fence, Backend: a.Backend, Outcome: a.Outcome, ErrorClass: a.ErrorClass,
			Error: a.Error, PromptTokens: a.PromptTokens, CompletionTokens: a.CompletionTokens,
			StartedAt: a.StartedAt.Unix(), EndedAt: a.EndedAt.Unix()}
	}
	writeJSON(w, http.StatusOK, out)
	return http.StatusOK
}

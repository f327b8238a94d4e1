package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvgate/kvgate/scheduler/validate"
	"github.com/kvgate/kvgate/store"
)

// A durable job runs as stages, in this order, each checkpointed under the
// claim's fence (Store.SaveStage) so that a retry resumes at the first
// stage without a checkpoint:
//
//   - inference: the backend call (runner.go's infer); its checkpoint is
//     the backend's answer, so no retry pays for the model twice;
//   - validation: the job's pinned policy judges the answer (package
//     validate); its checkpoint is the verdict. It never calls a backend.
//
// A job without a policy skips validation. A failing verdict ends the job
// REVIEW_REQUIRED, with the answer stored but withheld and the reasons in
// the checkpoint, for a review to decide. Before the stages, the entity
// gate (below) may hold a serial version back or supersede a beaten one.

// outcomeStore is what the validation stage needs of the store beyond
// jobStore; store.Store has it.
type outcomeStore interface {
	JobOutcome(ctx context.Context, jobID string) (store.JobOutcome, error)
}

// validation runs (or, from its checkpoint, resumes) the validation stage
// of job j on the inference's answer, and returns the state the job
// ends in: SUCCEEDED, or REVIEW_REQUIRED when the answer fails its
// policy. An error is the store's: nothing was decided, and the attempt
// should hand the job back without spending.
func (r *Runner) validation(wctx context.Context, j store.Job, answer []byte, f *facts) (store.State, error) {
	os, ok := r.st.(outcomeStore)
	if !ok {
		return store.Succeeded, nil
	}
	// The inference is paid for: its reads and writes go on through a
	// shutdown (wctx is not cancelled), like the attempt's end.
	ctx := wctx
	var o store.JobOutcome
	var err error
	// Its reads wait out a store briefly out of reach in place, as its
	// writes do (record): handed back, the attempt would hold the job
	// until its lease ran out, and the reap would count it.
	switch {
	case f == nil:
		err = r.record(ctx, func(ctx context.Context, _ time.Time) error {
			var rerr error
			o, rerr = os.JobOutcome(ctx, j.ID)
			return rerr
		})
	case f.outcome == nil:
		err = store.ErrNotFound
	default:
		o = *f.outcome // read with the claim
	}
	if errors.Is(err, store.ErrNotFound) {
		return store.Succeeded, nil // no policy: nothing to judge
	}
	if err != nil {
		return "", err
	}
	var v store.Validation
	var data []byte
	err = r.record(ctx, func(ctx context.Context, _ time.Time) error {
		var rerr error
		data, rerr = r.st.Stage(ctx, j.ID, store.StageValidation)
		return rerr
	})
	switch {
	case err == nil && json.Unmarshal(data, &v) == nil && v.Version == o.Version:
		r.m.stageReused.Inc() // judged before, by this version
	case err == nil, errors.Is(err, store.ErrNotFound):
		v = judge(j, o, answer)
		v.Fence = j.Fence
		data, _ = json.Marshal(v)
		if err := r.record(wctx, func(ctx context.Context, now time.Time) error {
			return r.st.SaveStage(ctx, j.ID, j.Fence, store.StageValidation, data, now)
		}); err != nil {
			return "", err
		}
	default:
		return "", err
	}
	if !v.Passed {
		return store.ReviewRequired, nil
	}
	return store.Succeeded, nil
}

// judge is the validation stage's verdict: pure, from the job's request,
// its pinned policy and the backend's answer.
func judge(j store.Job, o store.JobOutcome, answer []byte) store.Validation {
	v := store.Validation{Policy: o.Policy, Version: o.Version}
	var reasons []validate.Reason
	pol, err := validate.Parse(o.Document)
	if err != nil {
		reasons = []validate.Reason{{Rule: "policy", Code: "policy_invalid", Message: err.Error()}}
	} else if text, err := validate.Answer(answer); err != nil {
		reasons = []validate.Reason{{Rule: validate.RuleJSON, Code: validate.CodeInvalidJSON, Message: "the backend's answer has no content: " + err.Error()}}
	} else {
		req, _ := validate.ParseRequest(j.Body)
		source := o.Source
		if source == "" {
			source = req.Source()
		}
		reasons = pol.Check(validate.Input{Answer: text, RequestSchema: req.Schema(), Source: source})
	}
	v.Passed = len(reasons) == 0
	if !v.Passed {
		v.Reasons, _ = json.Marshal(reasons)
	}
	return v
}

// ClassOrdering is a serial entity version that waited for a lower one:
// a wait, spending nothing.
const ClassOrdering ErrorClass = "entity_ordering"

// entityStore is what per-entity ordering needs of the store beyond
// jobStore; store.Store has it.
type entityStore interface {
	JobEntity(ctx context.Context, jobID string) (store.JobEntity, error)
	EntityTurn(ctx context.Context, e store.JobEntity) (store.Turn, error)
}

// entityGate runs before the stages of a job that names an entity: a
// serial version whose predecessor has not ended is handed back to wait,
// and a version a higher one has beaten (latest wins) ends SUPERSEDED
// without running. It returns the job's entity (nil for none), for the
// completion to decide the winner, and whether the stages may run; when
// they may not, it has recorded the attempt's end. f is what the claim
// read of the job (nil: unread, and the gate reads the entity itself).
func (r *Runner) entityGate(ctx, wctx context.Context, log *slog.Logger, j store.Job, a store.Attempt, f *facts) (*store.JobEntity, bool) {
	es, ok := r.st.(entityStore)
	if !ok {
		return nil, true
	}
	var e store.JobEntity
	var err error
	rctx, stop := r.bounded(ctx)
	defer stop()
	switch {
	case f == nil:
		e, err = es.JobEntity(rctx, j.ID)
	case f.entity == nil:
		err = store.ErrNotFound
	default:
		e = *f.entity // read with the claim
	}
	if errors.Is(err, store.ErrNotFound) {
		return nil, true
	}
	var turn store.Turn
	if err == nil {
		turn, err = es.EntityTurn(rctx, e)
	}
	switch {
	case err != nil:
		r.failed(wctx, ctx, log, j, a, &ExecError{Class: ClassStore, Err: err})
		return nil, false
	case turn == store.TurnWait:
		r.failed(wctx, ctx, log, j, a, &ExecError{Class: ClassOrdering,
			Err: fmt.Errorf("entity %s version %d waits for a lower version to end", e.Key, e.Version)})
		return nil, false
	case turn == store.TurnSuperseded:
		a.Outcome, a.EndedAt = store.OutcomeSucceeded, r.cfg.Now()
		if err := r.recordEnd(wctx, j, func(ctx context.Context, now time.Time) error {
			return r.st.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Superseded, Reused: true,
				Entity: &e, Attempt: a, Now: now})
		}); err != nil {
			r.lost(log, err)
			return nil, false
		}
		r.m.finished.WithLabelValues("superseded").Inc()
		return nil, false
	}
	return &e, true
}

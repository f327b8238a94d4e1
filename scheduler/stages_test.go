package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// answerExecutor answers every call with a chat completion whose content
// is its answer.
type answerExecutor struct {
	calls  atomic.Int64
	answer string
}

func (e *answerExecutor) Prepare(ctx context.Context, j store.Job) (*Call, error) {
	return &Call{
		Ticket: &Ticket{Model: j.Model, PromptTokens: 10, MaxTokens: 10},
		Admit:  func(context.Context) error { return nil },
		Run: func(ctx context.Context, g *Grant, sending func() error) (Outcome, error) {
			if err := sending(); err != nil {
				return Outcome{}, err
			}
			e.calls.Add(1)
			b, _ := json.Marshal(map[string]any{"choices": []any{map[string]any{"message": map[string]any{"role": "assistant", "content": e.answer}}}})
			return Outcome{Body: b, PromptTokens: 10, CompletionTokens: 5}, nil
		},
		Release: func() {},
	}, nil
}

// outcomeOutage fails the validation stage's first reads of the job's
// policy and its first checkpoint writes, as a store restarting between
// the stages would.
type outcomeOutage struct {
	store.Store
	reads, stageReads, saves atomic.Int64 // failures left
}

func (s *outcomeOutage) JobOutcome(ctx context.Context, id string) (store.JobOutcome, error) {
	if s.reads.Add(-1) >= 0 {
		return store.JobOutcome{}, fmt.Errorf("job outcome: %w: connection refused", store.ErrUnavailable)
	}
	return s.Store.JobOutcome(ctx, id)
}

func (s *outcomeOutage) Stage(ctx context.Context, id, stage string) ([]byte, error) {
	if stage == store.StageValidation && s.stageReads.Add(-1) >= 0 {
		return nil, fmt.Errorf("stage: %w: connection refused", store.ErrUnavailable)
	}
	return s.Store.Stage(ctx, id, stage)
}

func (s *outcomeOutage) SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte, now time.Time) error {
	if stage == store.StageValidation && s.saves.Add(-1) >= 0 {
		return store.ErrLeaseLost // the claim lost the job between the stages
	}
	return s.Store.SaveStage(ctx, id, fence, stage, data, now)
}

// TestValidationReadWaitsInPlace: the validation stage's reads wait out
// a store briefly out of reach in place, as its writes do: the attempt
// ends the job itself, with no lease left to run out (this runner never
// reaps) and nothing spent but the inference.
func TestValidationReadWaitsInPlace(t *testing.T) {
	st := &outcomeOutage{Store: openStore(t)}
	st.stageReads.Store(2)
	ctx := context.Background()
	if _, err := st.PutPolicy(ctx, store.Policy{Tenant: "acme", Name: "p", CreatedAt: time.Now(),
		Document: json.RawMessage(`{"name":"p","rules":[{"rule":"json"}]}`)}); err != nil {
		t.Fatal(err)
	}
	exec := &answerExecutor{answer: `{"currency": "EUR"}`}
	f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute)
	j := f.submit(t, "k", func(n *store.NewJob) { n.Outcome = &store.NewOutcome{Policy: "p"} })
	got := f.waitState(t, j.ID, store.Succeeded)
	as, err := st.Attempts(ctx, j.ID)
	if err != nil || len(as) != 1 || exec.calls.Load() != 1 || got.Attempt != 1 || st.stageReads.Load() >= 0 {
		t.Errorf("attempts %+v (%v), %d backend calls, %d attempts spent, outage left %d: want one attempt, one call, the outage over",
			as, err, exec.calls.Load(), got.Attempt, st.stageReads.Load())
	}
}

// TestValidationRetryNeverCallsTheBackend: a validation stage that cannot
// run (the store out of reach, then the claim lost) is retried from the
// inference's checkpoint: the backend answered once, the attempt that
// paid for it is the only one spent, and the verdict lands.
func TestValidationRetryNeverCallsTheBackend(t *testing.T) {
	for _, tc := range []struct {
		answer string
		want   store.State
	}{
		{`{"currency": "EUR"}`, store.Succeeded},
		{`{"currency": "GBP"}`, store.ReviewRequired},
		{`the total is 30`, store.ReviewRequired},
	} {
		t.Run(string(tc.want)+" "+tc.answer, func(t *testing.T) {
			st := &outcomeOutage{Store: openStore(t)}
			st.reads.Store(1)
			st.saves.Store(1)
			ctx := context.Background()
			if _, err := st.PutPolicy(ctx, store.Policy{Tenant: "acme", Name: "p", CreatedAt: time.Now(),
				Document: json.RawMessage(`{"name":"p","rules":[{"rule":"json"},{"rule":"enum","pointer":"/currency","values":["EUR"]}]}`)}); err != nil {
				t.Fatal(err)
			}
			exec := &answerExecutor{answer: tc.answer}
			f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, 300*time.Millisecond)
			j := f.submit(t, "k", func(n *store.NewJob) { n.Outcome = &store.NewOutcome{Policy: "p"} })
			// The lost claim's lease runs out; the reaper hands the job on.
			stop := make(chan struct{})
			defer close(stop)
			go func() {
				for {
					select {
					case <-stop:
						return
					case <-time.After(50 * time.Millisecond):
						_, _ = st.Reap(ctx, time.Now(), 10)
						f.runner.Wake()
					}
				}
			}()
			got := f.waitState(t, j.ID, tc.want)
			if exec.calls.Load() != 1 || got.Attempt != 1 {
				t.Errorf("%d backend calls, %d attempts spent; want 1 and 1", exec.calls.Load(), got.Attempt)
			}
			data, err := st.Stage(ctx, j.ID, store.StageValidation)
			var v store.Validation
			if err != nil || json.Unmarshal(data, &v) != nil || v.Policy != "p" || v.Version != 1 || v.Passed != (tc.want == store.Succeeded) {
				t.Errorf("validation checkpoint %s, %v", data, err)
			}
			if tc.want == store.ReviewRequired && !strings.Contains(string(v.Reasons), `"code"`) {
				t.Errorf("reasons %s", v.Reasons)
			}
		})
	}
}

// factReads counts the reads of a job's entity and policy one job at a
// time; AttemptFacts, the read of a whole claim's, is *sqlstore.Store's.
type factReads struct {
	*sqlstore.Store
	entities, outcomes atomic.Int64
}

func (s *factReads) JobEntity(ctx context.Context, id string) (store.JobEntity, error) {
	s.entities.Add(1)
	return s.Store.JobEntity(ctx, id)
}

func (s *factReads) JobOutcome(ctx context.Context, id string) (store.JobOutcome, error) {
	s.outcomes.Add(1)
	return s.Store.JobOutcome(ctx, id)
}

// TestClaimReadsFactsOnce: the jobs' entities and policies are read with
// their claim, not by each attempt: no job is read alone, and each job
// still meets its own policy and entity rules.
func TestClaimReadsFactsOnce(t *testing.T) {
	st := &factReads{Store: openStore(t).(*sqlstore.Store)}
	ctx := context.Background()
	for name, currency := range map[string]string{"eur": "EUR", "gbp": "GBP"} {
		if _, err := st.PutPolicy(ctx, store.Policy{Tenant: "acme", Name: name, CreatedAt: time.Now(),
			Document: json.RawMessage(`{"name":"` + name + `","rules":[{"rule":"json"},{"rule":"enum","pointer":"/currency","values":["` + currency + `"]}]}`)}); err != nil {
			t.Fatal(err)
		}
	}
	f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, &answerExecutor{answer: `{"currency": "EUR"}`}, time.Minute)
	policy := func(name string) func(*store.NewJob) {
		return func(n *store.NewJob) { n.Outcome = &store.NewOutcome{Policy: name} }
	}
	entity := func(key string, version int64) func(*store.NewJob) {
		return func(n *store.NewJob) { n.Entity = &store.NewEntity{Key: key, Version: version} }
	}
	want := map[string]store.State{}
	for key, opts := range map[string][]func(*store.NewJob){
		"plain": nil, "eur": {policy("eur")}, "gbp": {policy("gbp")},
		"entity": {entity("order-1", 1)}, "both": {entity("order-2", 1), policy("gbp")},
	} {
		j := f.submit(t, key, opts...)
		want[j.ID] = store.Succeeded
		if key == "gbp" || key == "both" {
			want[j.ID] = store.ReviewRequired // the pinned policy judged the answer
		}
	}
	for id, st := range want {
		f.waitState(t, id, st)
	}
	if n, m := st.entities.Load(), st.outcomes.Load(); n != 0 || m != 0 {
		t.Errorf("%d entity and %d policy reads of one job; want none (read with the claim)", n, m)
	}
}

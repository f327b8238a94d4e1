package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/store"
)

func TestEmbedBatches(t *testing.T) {
	raw := func(n, size int) []json.RawMessage {
		out := make([]json.RawMessage, n)
		for i := range out {
			out[i] = json.RawMessage(`"` + strings.Repeat("x", size) + `"`)
		}
		return out
	}
	for _, tc := range []struct {
		n, size int
		want    string
	}{
		{1, 10, "[{0 1}]"},
		{256, 10, "[{0 256}]"},
		{257, 10, "[{0 256} {256 257}]"},
		{600, 10, "[{0 256} {256 512} {512 600}]"},
		{5, EmbedBatchBytes / 2, "[{0 1} {1 2} {2 3} {3 4} {4 5}]"}, // two no longer fit in the bytes
		{2, EmbedBatchBytes * 2, "[{0 1} {1 2}]"},                   // one too large alone is a batch of its own
	} {
		if got := fmt.Sprint(embedBatches(raw(tc.n, tc.size))); got != tc.want {
			t.Errorf("%d inputs of %d bytes: %s, want %s", tc.n, tc.size, got, tc.want)
		}
	}
}

func TestSplitEmbeddings(t *testing.T) {
	for body, ok := range map[string]bool{
		`{"model":"m","input":["a","b"]}`:   true,
		`{"model":"m","input":[[1,2],[3]]}`: true,
		`{"model":"m","input":[1,2,3]}`:     false, // one input of token ids
		`{"model":"m","input":"one"}`:       false,
		`{"model":"m","input":[]}`:          false,
		`not json`:                          false,
	} {
		if _, _, got := splitEmbeddings([]byte(body)); got != ok {
			t.Errorf("%s: split %v, want %v", body, got, ok)
		}
	}
}

func TestMergeEmbeddings(t *testing.T) {
	batches := []embedBatch{{0, 2}, {2, 3}}
	parts := [][]byte{
		[]byte(`{"object":"list","model":"m","data":[{"object":"embedding","index":1,"embedding":[1]},{"object":"embedding","index":0,"embedding":[0]}],"usage":{"prompt_tokens":4,"total_tokens":4}}`),
		[]byte(`{"object":"list","model":"m","data":[{"object":"embedding","index":0,"embedding":[2]}],"usage":{"prompt_tokens":3,"total_tokens":3}}`),
	}
	read := make([]embedPart, len(parts))
	for i, p := range parts {
		var err error
		if read[i], err = readEmbedBatch(p, batches[i]); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
	}
	b, err := mergeEmbeddings(read)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"object":"list","data":[{"embedding":[0],"index":0,"object":"embedding"},{"embedding":[1],"index":1,"object":"embedding"},{"embedding":[2],"index":2,"object":"embedding"}],"model":"m","usage":{"prompt_tokens":7,"total_tokens":7}}`
	if string(b) != want {
		t.Errorf("merged\n%s\nwant\n%s", b, want)
	}
	for _, bad := range [][]byte{
		[]byte(`{"data":[{"index":0}]}`),             // one embedding for two inputs
		[]byte(`{"data":[{"index":0},{"index":0}]}`), // an index twice
		[]byte(`{"data":[{"index":0},{"index":5}]}`), // out of range
		[]byte(`nope`),
	} {
		if _, err := readEmbedBatch(bad, batches[0]); err == nil {
			t.Errorf("%s read as batch 0's answer", bad)
		}
	}
}

// embedExecutor answers each embeddings request with one embedding an
// input; the first request is held until release closes.
type embedExecutor struct {
	calls   atomic.Int64
	started chan struct{}
	release chan struct{}
}

func (e *embedExecutor) Prepare(ctx context.Context, j store.Job) (*Call, error) {
	return &Call{
		Ticket: &Ticket{Model: j.Model, PromptTokens: 10, MaxTokens: 1},
		Admit:  func(context.Context) error { return nil },
		Run: func(ctx context.Context, g *Grant, sending func() error) (Outcome, error) {
			if err := sending(); err != nil {
				return Outcome{}, err
			}
			if e.calls.Add(1) == 1 {
				close(e.started)
				<-e.release
			}
			var req struct{ Input []string }
			if err := json.Unmarshal(j.Body, &req); err != nil {
				return Outcome{}, err
			}
			data := make([]map[string]any, len(req.Input))
			for i := range data {
				data[i] = map[string]any{"object": "embedding", "index": i, "embedding": []float64{float64(i)}}
			}
			b, _ := json.Marshal(map[string]any{"object": "list", "data": data, "model": j.Model,
				"usage": map[string]int{"prompt_tokens": len(req.Input), "total_tokens": len(req.Input)}})
			return Outcome{Body: b, PromptTokens: len(req.Input)}, nil
		},
		Release: func() {},
	}, nil
}

// submitTwoBatches submits an embeddings job of two batches' inputs.
func submitTwoBatches(t *testing.T, f *runnerFixture) store.Job {
	t.Helper()
	inputs := make([]string, EmbedBatchInputs+44)
	for i := range inputs {
		inputs[i] = fmt.Sprint("chunk ", i)
	}
	in, _ := json.Marshal(inputs)
	return f.submit(t, "k", func(n *store.NewJob) {
		n.Endpoint, n.Body = "/v1/embeddings", json.RawMessage(`{"model":"`+model+`","input":`+string(in)+`}`)
	})
}

// TestDrainBetweenEmbeddingsBatches: a drain that begins while an
// embeddings job's first batch is in flight lets that batch finish and be
// checkpointed, then hands the job back before the next batch is sent,
// spending nothing: a replica that stays resumes it from the checkpoint.
func TestDrainBetweenEmbeddingsBatches(t *testing.T) {
	st := openStore(t)
	exec := &embedExecutor{started: make(chan struct{}), release: make(chan struct{})}
	f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute)
	j := submitTwoBatches(t, f)
	<-exec.started
	f.runner.Drain()
	close(exec.release)
	var got store.Job
	eventually.True(t, "the job to be handed back", func() bool {
		var err error
		got, err = st.Get(context.Background(), "acme", j.ID)
		return err == nil && (got.State == store.Ready || got.State == store.RetryScheduled || got.State == store.Succeeded)
	})
	as, _ := st.Attempts(context.Background(), j.ID)
	if got.State == store.Succeeded || exec.calls.Load() != 1 || got.Attempt != 0 || len(as) != 1 || as[0].Spent {
		t.Errorf("job %s, %d attempts spent, %d requests, attempts %+v: want it handed back after one request, nothing spent",
			got.State, got.Attempt, exec.calls.Load(), as)
	}
	if _, err := st.Stage(context.Background(), j.ID, batchStage(0)); err != nil {
		t.Errorf("the first batch's checkpoint: %v", err)
	}
}

// TestAttemptAdmittingCount: admitting counts an attempt until it is
// admitted, once; a quota wait takes it out of the count only while it
// is counted, so that an embeddings attempt's later batches, admitted
// before, never take the count below the attempts still to admit.
func TestAttemptAdmittingCount(t *testing.T) {
	r := &Runner{}
	r.admitting.Store(1) // the claim counts it
	at := &attempt{r: r}
	for _, step := range []struct {
		name string
		do   func()
		want int64
	}{
		{"quota wait", at.waiting, 0},
		{"wait over", at.resumed, 1},
		{"admitted", at.admit, 0},
		{"admitted again", at.admit, 0},
		{"a later batch's quota wait", at.waiting, 0},
		{"its wait over", at.resumed, 0},
	} {
		step.do()
		if got := r.admitting.Load(); got != step.want {
			t.Fatalf("after %s: admitting %d, want %d", step.name, got, step.want)
		}
	}
}

// batchCheckpointOutage fails every checkpoint of an embeddings job's
// first batch, as a store out of reach for longer than a lease would.
type batchCheckpointOutage struct{ store.Store }

func (s batchCheckpointOutage) SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte, now time.Time) error {
	if stage == batchStage(0) {
		return fmt.Errorf("save stage: %w: connection refused", store.ErrUnavailable)
	}
	return s.Store.SaveStage(ctx, id, fence, stage, data, now)
}

// TestBatchCheckpointUnwritten: an embeddings batch that reached the
// backend and was answered, but whose checkpoint could not be written,
// is not recorded as a wait that spends nothing: as a single request's
// unwritten checkpoint, the attempt is left to the reaper, which counts
// it.
func TestBatchCheckpointUnwritten(t *testing.T) {
	st := openStore(t)
	exec := &embedExecutor{started: make(chan struct{}), release: make(chan struct{})}
	close(exec.release)
	const lease = 300 * time.Millisecond
	f := startRunnerOn(t, batchCheckpointOutage{st}, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, lease)
	j := submitTwoBatches(t, f)
	<-exec.started
	// The runner gives up on the checkpoint after a lease; then the lease
	// runs out, and a reap ends the attempt (this runner reaps hourly).
	eventually.True(t, "the attempt to end", func() bool {
		if _, err := st.Reap(context.Background(), time.Now(), 10); err != nil {
			t.Fatal(err)
		}
		as, _ := st.Attempts(context.Background(), j.ID)
		return len(as) > 0
	})
	as, _ := st.Attempts(context.Background(), j.ID)
	if a := as[0]; !a.Spent || !a.Sent || a.ErrorClass == string(ClassStore) {
		t.Errorf("the attempt whose batch checkpoint could not be written: %+v; want it spent and sent, ended by the reaper", a)
	}
}

// limitedEmbed is an embedExecutor that bounds a job's result.
type limitedEmbed struct {
	*embedExecutor
	limit int
}

func (e limitedEmbed) MaxResultBytes() int { return e.limit }

// TestEmbeddingsResultBounded: an embeddings job's batches each fit the
// executor's bound on an answer, but their merged result is bounded too:
// once the answers so far pass it, the job fails (its own doing: invalid)
// before another batch is paid for.
func TestEmbeddingsResultBounded(t *testing.T) {
	st := openStore(t)
	exec := limitedEmbed{&embedExecutor{started: make(chan struct{}), release: make(chan struct{})}, 1000}
	close(exec.release)
	f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute)
	j := submitTwoBatches(t, f)
	var got store.Job
	eventually.True(t, "the job to end", func() bool {
		got, _ = st.Get(context.Background(), "acme", j.ID)
		return got.State.Final()
	})
	if got.State != store.FailedTerminal || got.ErrorClass != string(ClassInvalid) || !strings.Contains(got.LastError, "over 1000 bytes") || exec.calls.Load() != 1 {
		t.Errorf("job %s (%s: %s) after %d requests; want FAILED_TERMINAL invalid after one", got.State, got.ErrorClass, got.LastError, exec.calls.Load())
	}
}

package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Resumable multi-input embeddings. An embeddings job whose input is a
// list of many chunks runs its inference stage as batches: each batch is
// its own request, admitted like any job request (its own quota permit,
// or its charge carried with the attempt's, and KV grant, sized to what
// it holds), and each batch's answer is
// checkpointed under the fence as the stage "inference/batch/NNNNN"
// before the next one is sent. A retry after a failure at chunk 7,000
// finds the checkpoints of the batches before it and embeds only what is
// missing. The stage's output, checkpointed as "inference" like any
// job's answer, lists the embeddings in input order, with usage summed
// over every batch.

const (
	// EmbedBatchInputs and EmbedBatchBytes bound one batch: at most this
	// many inputs, and at most this many bytes of them (about a
	// quarter of that in tokens), whichever comes first.
	EmbedBatchInputs = 256
	EmbedBatchBytes  = 64 << 10
	// MaxEmbedInputs bounds a job's input list.
	MaxEmbedInputs = 10_000
)

type embedBatch struct{ lo, hi int }

// embedBatches splits inputs into batches.
func embedBatches(inputs []json.RawMessage) []embedBatch {
	var out []embedBatch
	lo, bytes := 0, 0
	for i, in := range inputs {
		if i > lo && (i-lo >= EmbedBatchInputs || bytes+len(in) > EmbedBatchBytes) {
			out = append(out, embedBatch{lo, i})
			lo, bytes = i, 0
		}
		bytes += len(in)
	}
	if lo < len(inputs) {
		out = append(out, embedBatch{lo, len(inputs)})
	}
	return out
}

// splitEmbeddings reads an embeddings body whose input is a list of
// chunks (strings or token lists); ok is false for any other input.
func splitEmbeddings(body []byte) (map[string]json.RawMessage, []json.RawMessage, bool) {
	var req map[string]json.RawMessage
	if json.Unmarshal(body, &req) != nil {
		return nil, nil, false
	}
	var inputs []json.RawMessage
	if json.Unmarshal(req["input"], &inputs) != nil || len(inputs) == 0 {
		return nil, nil, false
	}
	// A list of token ids is one input, not many.
	var ids []int
	if json.Unmarshal(req["input"], &ids) == nil {
		return nil, nil, false
	}
	return req, inputs, true
}

// EmbedInputs is how many inputs an embeddings request body holds as
// the runner splits it into batches (0: not a list of inputs, which runs
// as one request), for the cap of MaxEmbedInputs at submission.
func EmbedInputs(body []byte) int {
	_, inputs, _ := splitEmbeddings(body)
	return len(inputs)
}

func batchStage(i int) string { return fmt.Sprintf("%s/batch/%05d", store.StageInference, i) }

// inferStage runs the inference stage: one request, or an embeddings
// job's batches, resuming after the checkpointed ones. It returns the
// stage's output with the tokens this attempt spent.
func (r *Runner) inferStage(ctx context.Context, j store.Job, a *store.Attempt, at *attempt) (Outcome, error) {
	if j.Endpoint != "/v1/embeddings" {
		return r.infer(ctx, j, a, at, store.Spent{})
	}
	req, inputs, ok := splitEmbeddings(j.Body)
	if !ok {
		return r.infer(ctx, j, a, at, store.Spent{})
	}
	batches := embedBatches(inputs)
	if len(batches) == 1 {
		return r.infer(ctx, j, a, at, store.Spent{})
	}
	wctx := context.WithoutCancel(ctx)
	parts := make([]embedPart, len(batches))
	var (
		spent   Outcome
		earlier store.Spent // what this attempt's batches used, each charged with the attempt's end
		size    int         // the batches' answers so far: what the merged result will be, about
	)
	// The merged result is bounded as one answer is: each batch's answer
	// fits the executor's bound, but ten thousand inputs make one that
	// does not, which would be held whole by every read of the result.
	limit := 0
	if l, ok := r.exec.(ResultLimiter); ok {
		limit = l.MaxResultBytes()
	}
	tooLarge := func() error {
		return &ExecError{Class: ClassInvalid, Err: fmt.Errorf(
			"the embeddings of the job's %d inputs are over %d bytes, the most a job's result holds: split them into smaller jobs, or ask for encoding_format base64",
			len(inputs), limit)}
	}
	for i, b := range batches {
		if limit > 0 && size > limit {
			return Outcome{}, tooLarge() // before another batch is paid for
		}
		sctx, stop := r.bounded(ctx)
		data, err := r.st.Stage(sctx, j.ID, batchStage(i))
		stop()
		if err == nil {
			// A checkpoint that does not answer its batch (written before
			// answers were checked) is sent again, not reused.
			if parts[i], err = readEmbedBatch(data, b); err == nil {
				r.m.stageReused.Inc()
				size += len(data)
				continue
			}
		} else if !errors.Is(err, store.ErrNotFound) {
			return Outcome{}, &ExecError{Class: ClassStore, Err: err}
		}
		if a.Sent {
			// Between two requests the attempt holds none that has left:
			// a drain hands the job back here, its batches so far
			// checkpointed, spending nothing.
			at.unsent()
			if ctx.Err() != nil {
				return Outcome{}, context.Cause(ctx)
			}
		}
		sub := j
		req["input"], _ = json.Marshal(inputs[b.lo:b.hi])
		sub.Body, _ = json.Marshal(req)
		// A checkpointed batch is never paid again, so a lost attempt must
		// not take its usage with it: each batch's charge carries the
		// batches before it (infer), whose reservations its sent mark
		// holds for a reap.
		before := a.Charge
		out, err := r.infer(ctx, sub, a, at, earlier)
		if err != nil {
			return Outcome{}, err
		}
		if a.Charge != before && a.Charge.Outcome == store.Reported {
			earlier.Spend(*a.Charge) // a.Charge.Earlier is earlier already
		}
		spent.PromptTokens += out.PromptTokens
		spent.CompletionTokens += out.CompletionTokens
		// An answer that does not fit its batch is the backend's failure,
		// and never a checkpoint: reused, it would fail every retry
		// without a request sent.
		if parts[i], err = readEmbedBatch(out.Body, b); err != nil {
			return Outcome{}, &ExecError{Class: ClassBackend, Err: fmt.Errorf("batch %d: %w", i, err)}
		}
		size += len(out.Body)
		if err := r.record(wctx, func(ctx context.Context, now time.Time) error {
			return r.st.SaveStage(ctx, j.ID, j.Fence, batchStage(i), out.Body, now)
		}); err != nil {
			// The batch reached the backend and was answered: as for a
			// single request's checkpoint that cannot be written, the
			// reaper counts the attempt (failed: errUnrecorded).
			return Outcome{}, fmt.Errorf("checkpoint batch %d: %w: %w", i, errUnrecorded, err)
		}
	}
	body, err := mergeEmbeddings(parts)
	if err != nil {
		return Outcome{}, &ExecError{Class: ClassBackend, Err: err}
	}
	if limit > 0 && len(body) > limit {
		return Outcome{}, tooLarge()
	}
	spent.Body = body
	return spent, nil
}

// ResultLimiter is an Executor that bounds the answers it reads: a job's
// merged result is bounded the same.
type ResultLimiter interface{ MaxResultBytes() int }

// embedPart is one batch's answer, read: its embeddings in input order,
// their indexes the job's.
type embedPart struct {
	data          []map[string]json.RawMessage
	model         string
	prompt, total int
}

// readEmbedBatch reads batch b's answer p: one embedding for each of the
// batch's inputs, each index once.
func readEmbedBatch(p []byte, b embedBatch) (embedPart, error) {
	var a struct {
		Data  []map[string]json.RawMessage `json:"data"`
		Model string                       `json:"model"`
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			TotalTokens  int `json:"total_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(p, &a); err != nil {
		return embedPart{}, fmt.Errorf("the answer: %w", err)
	}
	if len(a.Data) != b.hi-b.lo {
		return embedPart{}, fmt.Errorf("the answer has %d embeddings for %d inputs", len(a.Data), b.hi-b.lo)
	}
	ordered := make([]map[string]json.RawMessage, len(a.Data))
	for k, d := range a.Data {
		var idx int
		if err := json.Unmarshal(d["index"], &idx); err != nil || idx < 0 || idx >= len(a.Data) || ordered[idx] != nil {
			return embedPart{}, fmt.Errorf("the answer's embedding %d has a bad index", k)
		}
		d["index"], _ = json.Marshal(b.lo + idx)
		ordered[idx] = d
	}
	return embedPart{data: ordered, model: a.Model, prompt: a.Usage.PromptTokens, total: a.Usage.TotalTokens}, nil
}

// mergeEmbeddings joins the batches' answers into one, in input order.
func mergeEmbeddings(parts []embedPart) ([]byte, error) {
	type usage struct {
		PromptTokens int `json:"prompt_tokens"`
		TotalTokens  int `json:"total_tokens"`
	}
	out := struct {
		Object string                       `json:"object"`
		Data   []map[string]json.RawMessage `json:"data"`
		Model  string                       `json:"model"`
		Usage  usage                        `json:"usage"`
	}{Object: "list"}
	for _, p := range parts {
		out.Data = append(out.Data, p.data...)
		out.Model = p.model
		out.Usage.PromptTokens += p.prompt
		out.Usage.TotalTokens += p.total
	}
	return json.Marshal(out)
}

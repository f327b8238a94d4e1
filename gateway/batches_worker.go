package gateway

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/kvgate/kvgate/store"
)

// The batch worker: every replica runs one (RunBatches). It validates new
// batches, watches running ones, and finalizes those whose lines have all
// ended, each under a lease on the batch (store.Batch.Fence), so that
// one replica at a time works on a batch and a replica that dies midway
// is taken over once its lease lapses.

// batchKeyPrefix starts the idempotency key of every batch line's job.
const batchKeyPrefix = "kvgate-batch/"

// acceptChunk is how many lines one bulk insert writes, at most; and
// acceptBytes how many bytes of request bodies, so that a batch of long
// lines costs no more memory per statement than one of short lines.
const (
	acceptChunk   = 2000
	acceptBytes   = 1 << 20
	acceptWriters = 4
)

// maxBatchErrors bounds the errors a failed validation records.
const maxBatchErrors = 1000

// batchWork wakes the batch worker; page is how many open batches one
// read finds (0: batchWorkPage).
type batchWork struct {
	ch   chan struct{}
	page int
}

func (b batchWork) wake() {
	select {
	case b.ch <- struct{}{}:
	default:
	}
}

// batchLease and batchPoll are the worker's lease on a batch and how often
// it looks for work without being woken.
func (s *Server) batchLease() time.Duration { return cmp.Or(s.jobs.BatchLease, 30*time.Second) }
func (s *Server) batchPoll() time.Duration  { return cmp.Or(s.jobs.BatchPoll, time.Second) }

// RunBatches runs the batch worker until ctx ends; without a store that
// keeps batches it only waits. Its work is leased, so a replica that
// stops midway loses nothing: another takes the batch over.
func (s *Server) RunBatches(ctx context.Context) error {
	if s.batches == nil {
		<-ctx.Done()
		return nil
	}
	t := time.NewTicker(s.batchPoll())
	defer t.Stop()
	var swept time.Time
	for {
		now := time.Now()
		if now.Sub(swept) > 5*time.Minute {
			if _, err := s.batches.SweepFiles(ctx, now.Add(-abandonedFileAge), now, 100); err != nil && ctx.Err() == nil {
				s.log.Warn("sweeping files", "err", err)
			}
			swept = now
		}
		// Every open batch, a page at a time.
		page := cmp.Or(s.batchWk.page, batchWorkPage)
		for after := ""; ctx.Err() == nil; {
			bs, err := s.batches.BatchesToWork(ctx, now, after, page)
			if err != nil && ctx.Err() == nil {
				s.log.Warn("looking for batch work", "err", err)
			}
			for _, b := range bs {
				if ctx.Err() != nil {
					break
				}
				if err := s.workBatch(ctx, b); err != nil && ctx.Err() == nil && !errors.Is(err, store.ErrLeaseLost) {
					s.log.Warn("batch work", "batch", b.ID, "status", b.Status, "err", err)
				}
			}
			if len(bs) < page {
				break
			}
			after = bs[len(bs)-1].ID
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-s.batchWk.ch:
		}
	}
}

// batchWorkPage is how many open batches one read finds.
const batchWorkPage = 256

// workBatch moves one batch on as far as it can now.
func (s *Server) workBatch(ctx context.Context, b store.Batch) error {
	now := time.Now()
	switch b.Status {
	case store.BatchValidating:
		fence, err := s.batches.LeaseBatch(ctx, b.ID, b.Fence, now, s.batchLease())
		if err != nil {
			return err
		}
		return s.validateBatch(ctx, b, fence)
	case store.BatchInProgress:
		// A batch whose lines have all ended is completed, even when this
		// look comes after its window: it is expired only with lines open.
		open, err := s.batches.BatchOpen(ctx, b.ID)
		switch {
		case err != nil:
			return err
		case !open:
			return s.finalizeBatch(ctx, b, store.BatchCompleted)
		case !now.Before(b.ExpiresAt):
			return s.finalizeBatch(ctx, b, store.BatchExpired)
		}
		return nil
	case store.BatchCancelling:
		if !now.Before(b.ExpiresAt) {
			// The window ended before the cancel did: the lines still open
			// are cut by it, running ones too, as an in-progress batch's.
			open, err := s.batches.BatchOpen(ctx, b.ID)
			if err != nil {
				return err
			}
			if open {
				return s.finalizeBatch(ctx, b, store.BatchExpired)
			}
		}
		// Queued lines are cancelled at once; running ones finish.
		if _, err := s.batches.CancelBatchLines(ctx, b.ID, false, now); err != nil {
			return err
		}
		open, err := s.batches.BatchOpen(ctx, b.ID)
		if err != nil || open {
			return err
		}
		return s.finalizeBatch(ctx, b, store.BatchCancelled)
	case store.BatchFinalizing:
		// A finalizer lost its lease: start over.
		return s.finalizeBatch(ctx, b, b.EndStatus)
	}
	return nil
}

// abandonedFileAge is how long a file may stay incomplete before the
// sweep takes it: longer than any upload or batch output still being
// written (a 512 MiB upload over a slow link takes hours), since an
// incomplete file's row says when it began, not when it last moved. A
// deleted file's rest (hidden, begun at 0) goes at the next sweep, and an
// upload that fails deletes its own file at once.
const abandonedFileAge = 24 * time.Hour

// chunkReader reads a stored file chunk by chunk.
type chunkReader struct {
	ctx context.Context
	st  batchStore
	id  string
	seq int
	buf []byte
	err error
}

func (c *chunkReader) Read(p []byte) (int, error) {
	for len(c.buf) == 0 {
		if c.err != nil {
			return 0, c.err
		}
		b, err := c.st.FileChunk(c.ctx, c.id, c.seq)
		switch {
		case errors.Is(err, store.ErrNotFound):
			c.err = io.EOF
		case err != nil:
			c.err = err
		default:
			c.buf = b
			c.seq++
		}
	}
	n := copy(p, c.buf)
	c.buf = c.buf[n:]
	return n, nil
}

// eachLine calls fn with every line of a stored file that holds more than
// white space, and its line number (from 1). A line longer than the
// largest request body (Config.MaxBodyBytes) is not read into memory: fn
// gets it as nil, to refuse it.
func (s *Server) eachLine(ctx context.Context, fileID string, fn func(n int, line []byte) error) error {
	br := bufio.NewReaderSize(&chunkReader{ctx: ctx, st: s.batches, id: fileID}, 64<<10)
	limit := int(s.cfg.MaxBodyBytes) + 1<<10 // the body and its line's envelope
	var line []byte
	for n := 1; ; n++ {
		line = line[:0]
		tooLong := false
		var err error
		for {
			var part []byte
			part, err = br.ReadSlice('\n')
			if !tooLong {
				if len(line)+len(part) > limit {
					tooLong, line = true, line[:0]
				} else {
					line = append(line, part...)
				}
			}
			if !errors.Is(err, bufio.ErrBufferFull) {
				break
			}
		}
		switch {
		case tooLong:
			if ferr := fn(n, nil); ferr != nil {
				return ferr
			}
		case len(bytes.TrimSpace(line)) > 0:
			if ferr := fn(n, line); ferr != nil {
				return ferr
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// batchInput is one line of an input file: OpenAI's BatchRequestInput.
type batchInput struct {
	CustomID *string         `json:"custom_id"`
	Method   string          `json:"method"`
	URL      string          `json:"url"`
	Body     json.RawMessage `json:"body"`
}

// lineMeta is what validation keeps of a line for its acceptance.
type lineMeta struct {
	model  string
	tokens int32
}

// validateBatch reads the input file once, checking every line; then
// either fails the batch with the lines' errors or accepts every line as
// a job, in bulk, and starts it.
func (s *Server) validateBatch(ctx context.Context, b store.Batch, fence int64) error {
	lease := s.batchLease()
	// A batch whose priority base is set had every line valid at an
	// earlier validation, which began accepting them as jobs before its
	// claim was lost: a failure now cancels the lines already in, so that
	// none of a failed batch runs.
	accepting := b.PriorityBase != 0
	fail := func(errs []batchError, total int) error {
		if accepting {
			if _, err := s.batches.CancelBatchLines(ctx, b.ID, true, time.Now()); err != nil {
				return err
			}
		}
		raw, _ := json.Marshal(errs)
		if err := s.batches.FailBatch(ctx, b.Tenant, b.ID, fence, raw, total, "", time.Now()); err != nil {
			return err
		}
		s.wakeJobs()
		return nil
	}
	f, err := s.batches.File(ctx, b.Tenant, b.InputFileID, time.Now())
	if errors.Is(err, store.ErrNotFound) {
		return fail([]batchError{{Code: "invalid_file", Message: fmt.Sprintf("The input file %s no longer exists.", b.InputFileID)}}, 0)
	}
	if err != nil {
		return err
	}
	ep, ok := jobEndpoints[b.Endpoint]
	if !ok {
		return fail([]batchError{{Code: "invalid_endpoint", Message: fmt.Sprintf("The endpoint %s cannot be batched.", b.Endpoint)}}, 0)
	}
	var (
		errs   []batchError
		nErrs  int
		metas  []lineMeta
		seen   = map[string]struct{}{}
		models = map[string]string{} // interned
		model  string
	)
	addErr := func(line int, code, param, msg string) {
		nErrs++
		if len(errs) < maxBatchErrors {
			e := batchError{Code: code, Message: msg, Line: &line}
			if param != "" {
				e.Param = &param
			}
			errs = append(errs, e)
		}
	}
	began := time.Now()
	err = s.eachLine(ctx, f.ID, func(n int, line []byte) error {
		if len(metas)%acceptChunk == acceptChunk-1 {
			if err := s.batches.RenewBatch(ctx, b.ID, fence, time.Now(), lease); err != nil {
				return err
			}
		}
		metas = append(metas, lineMeta{})
		if len(metas) > maxBatchFileLines {
			if len(metas) == maxBatchFileLines+1 {
				addErr(n, "too_many_requests", "", fmt.Sprintf("A batch holds at most %d requests.", maxBatchFileLines))
			}
			return nil
		}
		if line == nil {
			addErr(n, "request_too_large", "body", fmt.Sprintf("This line is larger than the %d bytes a request body may be.", s.cfg.MaxBodyBytes))
			return nil
		}
		var in batchInput
		if err := json.Unmarshal(line, &in); err != nil {
			addErr(n, "invalid_json_line", "", "This line is not parseable as valid JSON.")
			return nil
		}
		switch {
		case in.CustomID == nil || *in.CustomID == "":
			addErr(n, "missing_required_parameter", "custom_id", "Missing required parameter: 'custom_id'.")
			return nil
		case !storableText(*in.CustomID):
			// PostgreSQL refuses a NUL in text: the line's job could not be
			// stored, and the batch would never leave validating.
			addErr(n, "invalid_value", "custom_id", "custom_id must be text without NUL characters.")
			return nil
		case in.Method != "POST":
			addErr(n, "invalid_method", "method", "The method of each request must be POST.")
			return nil
		case in.URL != b.Endpoint:
			addErr(n, "invalid_url", "url", fmt.Sprintf("The url of this request (%s) does not match the batch's endpoint (%s).", in.URL, b.Endpoint))
			return nil
		case len(in.Body) == 0 || string(in.Body) == "null":
			addErr(n, "missing_required_parameter", "body", "Missing required parameter: 'body'.")
			return nil
		}
		if _, dup := seen[*in.CustomID]; dup {
			addErr(n, "duplicate_custom_id", "custom_id",
				"The custom_id for this request is a duplicate of another request. The custom_id parameter must be unique for each request in a batch.")
			return nil
		}
		seen[*in.CustomID] = struct{}{}
		c, err := parseCall(in.Body, ep)
		if err != nil {
			param := "body"
			var api *apiError
			if errors.As(err, &api) && api.param != "" {
				param = "body." + api.param
			}
			addErr(n, "invalid_request", param, err.Error())
			return nil
		}
		if c.f.Stream {
			addErr(n, "invalid_request", "body.stream", "A batch's results are stored, not streamed: leave stream unset.")
			return nil
		}
		// An alias resolves as a job's does (aliases.go); the line's body
		// keeps the alias, resolved again when the line runs.
		asked := c.model
		m, err := s.resolveCall(c, "body.model")
		if err != nil {
			addErr(n, "model_not_found", "body.model", fmt.Sprintf("The model `%s` does not exist or you do not have access to it.", asked))
			return nil
		}
		prompt := s.est.estimate(m.ID, c.promptBytes)
		total, _ := s.reservationWith(c, m, prompt)
		if (m.MaxModelLen > 0 && prompt > m.MaxModelLen) || total > maxJobTokens {
			addErr(n, "context_length_exceeded", "body", fmt.Sprintf("This request's prompt (about %d tokens) does not fit the model's context of %d tokens.", prompt, m.MaxModelLen))
			return nil
		}
		if _, ok := models[m.ID]; !ok {
			models[m.ID] = m.ID
		}
		if model == "" {
			model = m.ID
		}
		metas[len(metas)-1] = lineMeta{model: models[m.ID], tokens: int32(total)}
		return nil
	})
	if err != nil {
		return err
	}
	validated := time.Since(began)
	if len(metas) == 0 {
		return fail([]batchError{{Code: "empty_file", Message: "The input file holds no requests."}}, 0)
	}
	if nErrs > 0 && accepting && !time.Now().Before(b.ExpiresAt) {
		// Tried again until its window ended (below): it fails, the lines
		// already in cancelled, rather than being tried for ever.
		return fail([]batchError{{Code: "batch_expired", Message: fmt.Sprintf("The batch's completion window (%s) ended before all its lines could be accepted (line %d: %s).",
			b.CompletionWindow, *errs[0].Line, errs[0].Message)}}, len(metas))
	}
	if nErrs > 0 && accepting {
		// Every line was valid when acceptance began: what fails now is
		// this replica's view (no backend serving a model yet after a
		// restart, its token estimates not yet learned), not the file.
		// The batch stays validating, tried again after its lease, until
		// its window ends (above).
		return fmt.Errorf("batch %s: %d of its lines, valid when their acceptance began, fail here now (line %d: %s): tried again later",
			b.ID, nErrs, *errs[0].Line, errs[0].Message)
	}
	if nErrs > 0 {
		return fail(errs, len(metas))
	}
	if b.PriorityBase == 0 { // not yet accepted, even in part
		var tokens int64
		for _, m := range metas {
			tokens += int64(m.tokens)
		}
		if msg, err := s.batchRoom(ctx, b, int64(len(metas)), tokens); errors.Is(err, errTenantDeleted) {
			return fail([]batchError{{Code: "tenant_deleted", Message: "The batch's tenant was deleted."}}, len(metas))
		} else if err != nil {
			return err
		} else if msg != "" {
			return fail([]batchError{{Code: "token_limit_exceeded", Message: msg}}, len(metas))
		}
	}
	// The room held for the lines ends once they are in, where they
	// count themselves (or, should this replica die, with its lease; a
	// takeover ends it too).
	defer s.endBatchRoom(ctx, b)
	// Every line is valid: each becomes a job, in bulk. A second
	// validation (this one's lease lapsed) finds the lines already
	// inserted under their keys and the same priorities.
	base := b.PriorityBase
	if base == 0 {
		if base, err = s.batches.BatchPriorityBase(ctx, b.Tenant); err != nil {
			return err
		}
		if err := s.batches.SetBatchPriorityBase(ctx, b.ID, fence, base); err != nil {
			return err
		}
	}
	now := time.Now()
	var (
		jobs    = make([]store.NewJob, 0, acceptChunk)
		customs = make([]string, 0, acceptChunk)
		i       int
		bodies  int // bytes of the bodies in jobs
	)
	// Chunks are written by acceptWriters statements at once, each on a
	// connection of its own: the database's time, not kvgate's, is most
	// of an acceptance.
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(acceptWriters)
	flush := func() error {
		if err := s.batches.RenewBatch(ctx, b.ID, fence, time.Now(), lease); err != nil {
			return err
		}
		if gctx.Err() != nil {
			return context.Cause(gctx) // a writer failed; g.Wait says why
		}
		js, cs := jobs, customs
		g.Go(func() error { return s.batches.AcceptBatchLines(gctx, b.ID, fence, js, cs) })
		jobs, customs, bodies = make([]store.NewJob, 0, acceptChunk), make([]string, 0, acceptChunk), 0
		return nil
	}
	err = s.eachLine(ctx, f.ID, func(n int, line []byte) error {
		var in batchInput
		if err := json.Unmarshal(line, &in); err != nil || i >= len(metas) {
			return fmt.Errorf("batch %s: line %d changed since it was validated", b.ID, n)
		}
		m := metas[i]
		jobs = append(jobs, store.NewJob{
			ID: uuid.Must(uuid.NewV7()).String(), Tenant: b.Tenant, IdempotencyKey: fmt.Sprintf("%s%s/%d", batchKeyPrefix, b.ID, i),
			RequestHash: requestHash(b.Endpoint, in.Body), Endpoint: b.Endpoint, Model: m.model, Body: in.Body,
			Priority: min(base+i, maxJobTokens), TokenEstimate: int(m.tokens), MaxAttempts: s.jobs.MaxAttempts,
			Deadline: b.ExpiresAt, Now: now,
		})
		customs = append(customs, *in.CustomID)
		i++
		bodies += len(in.Body)
		if len(jobs) == acceptChunk || bodies >= acceptBytes {
			return flush()
		}
		return nil
	})
	if err == nil && len(jobs) > 0 {
		err = flush()
	}
	if werr := g.Wait(); err == nil || errors.Is(err, context.Canceled) {
		err = cmp.Or(werr, err)
	}
	if err == nil && i != len(metas) {
		// The file lost lines between the two reads (it was deleted):
		// the batch fails, and the lines already in go with it.
		accepting = true
		return fail([]batchError{{Code: "invalid_file", Message: fmt.Sprintf("The input file %s changed while it was validated.", f.ID)}}, len(metas))
	}
	if err != nil {
		return err
	}
	if err := s.batches.StartBatch(ctx, b.ID, fence, len(metas), model, time.Now()); err != nil {
		return err
	}
	s.log.Info("batch accepted", "batch", b.ID, "tenant", b.Tenant, "lines", len(metas), "bytes", f.Bytes,
		"validated_in", validated.Round(time.Millisecond), "accepted_in", (time.Since(began) - validated).Round(time.Millisecond))
	s.wakeJobs()
	return nil
}

// batchRoomLease bounds how long a batch's reservation of room under its
// tenant's pending-job limits outlives a replica that died accepting it.
const batchRoomLease = 10 * time.Minute

// batchRoomID names a batch's reservation.
func batchRoomID(b store.Batch) string { return "batch:" + b.ID }

// batchRoom reserves room for a batch of lines jobs, reserving tokens,
// under its tenant's pending-job limits (those a job's submission meets),
// checked and held in one transaction (store.Batches.ReserveBatch), so
// that batches accepted at the same moment never pass a limit together:
// a message saying which limit it would exceed, or "" when it fits.
func (s *Server) batchRoom(ctx context.Context, b store.Batch, lines, tokens int64) (string, error) {
	if s.cfg.Tenants.Store == nil {
		return "", nil
	}
	t, found, err := s.tenant(ctx, b.Tenant)
	if err != nil || !found || (t.Limits.MaxPendingJobs <= 0 && t.Limits.MaxPendingTokens <= 0) {
		return "", err
	}
	err = s.batches.ReserveBatch(ctx, batchRoomID(b), b.Tenant, lines, tokens, t.Limits, time.Now(), batchRoomLease)
	var qe *store.QuotaError
	switch l := t.Limits; {
	case !errors.As(err, &qe):
		return "", err
	case qe.Limit == "pending_jobs":
		return fmt.Sprintf("The batch's %d requests would exceed your limit of %d pending jobs (%d pending now).", lines, l.MaxPendingJobs, qe.Used), nil
	default:
		return fmt.Sprintf("The batch's %d tokens would exceed your limit of %d tokens of pending jobs (%d pending now).", tokens, l.MaxPendingTokens, qe.Used), nil
	}
}

// endBatchRoom ends a batch's reservation, if it holds one.
func (s *Server) endBatchRoom(ctx context.Context, b store.Batch) {
	if s.cfg.Tenants.Store == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := s.cfg.Tenants.Store.EndJobReservation(ctx, batchRoomID(b)); err != nil {
		s.log.Warn("end batch reservation", "batch", b.ID, "err", err) // its lease ends it
	}
}

func (s *Server) wakeJobs() {
	if s.jobs.Wake != nil {
		s.jobs.Wake()
	}
}

// batchOutput is one line of an output or error file: OpenAI's
// BatchRequestOutput.
type batchOutput struct {
	ID       string          `json:"id"`
	CustomID string          `json:"custom_id"`
	Response *batchResponse  `json:"response"`
	Error    *batchLineError `json:"error"`
}

type batchResponse struct {
	StatusCode int             `json:"status_code"`
	RequestID  string          `json:"request_id"`
	Body       json.RawMessage `json:"body"`
}

type batchLineError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// httpFailure is how a batch line's job records a backend's error
// answer (its last_error), so that its line in the error file can carry
// the status and body: see lineError.
type httpFailure struct {
	StatusCode int             `json:"status_code"`
	Body       json.RawMessage `json:"body"`
}

// lineError wraps a backend's error answer to a batch line's request so
// that the job's recorded error is the answer itself, status and body;
// other jobs' errors are left as they are.
func lineError(j store.Job, status int, body []byte, err error) error {
	if !strings.HasPrefix(j.IdempotencyKey, batchKeyPrefix) || status < 400 || err == nil {
		return err
	}
	raw := json.RawMessage(body)
	if !json.Valid(body) {
		raw = mustJSON(map[string]any{"error": map[string]any{"message": err.Error(), "type": "server_error", "param": nil, "code": nil}})
	}
	b, _ := json.Marshal(httpFailure{StatusCode: status, Body: raw})
	return &recordedError{msg: string(b), err: err}
}

type recordedError struct {
	msg string
	err error
}

func (e *recordedError) Error() string { return e.msg }
func (e *recordedError) Unwrap() error { return e.err }

// outputLine is a batch line's line in the output file (ok) or the error
// file; end is the status the batch ends in.
func outputLine(l store.BatchLine, end string) (line batchOutput, ok bool) {
	id := strings.ReplaceAll(l.JobID, "-", "")
	line = batchOutput{ID: "batch_req_" + id, CustomID: l.CustomID}
	switch {
	case l.State == store.Succeeded || l.State == store.ReviewRequired:
		line.Response = &batchResponse{StatusCode: 200, RequestID: "req_" + id, Body: l.Result}
		return line, true
	case l.State == store.Cancelled && end == store.BatchExpired, l.ErrorClass == "deadline_exceeded":
		line.Error = &batchLineError{Code: "batch_expired", Message: "This request could not be executed before the completion window expired."}
	case l.State == store.Cancelled && end == store.BatchCancelled:
		line.Error = &batchLineError{Code: "batch_cancelled", Message: "This request was not executed: the batch was cancelled."}
	case l.State == store.Cancelled:
		line.Error = &batchLineError{Code: "cancelled", Message: "This request's job was cancelled."}
	default:
		var hf httpFailure
		if json.Unmarshal([]byte(l.LastError), &hf) == nil && hf.StatusCode >= 400 && len(hf.Body) > 0 {
			line.Response = &batchResponse{StatusCode: hf.StatusCode, RequestID: "req_" + id, Body: hf.Body}
			return line, false
		}
		line.Error = &batchLineError{Code: cmp.Or(l.ErrorClass, "failed"), Message: cmp.Or(l.LastError, "The request failed.")}
	}
	return line, false
}

// addUsage adds a result's usage (chat, completions, embeddings or
// responses) to the batch's.
func addUsage(u *batchUsage, result json.RawMessage) {
	var r struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			CompletionTokens    int `json:"completion_tokens"`
			InputTokens         int `json:"input_tokens"`
			OutputTokens        int `json:"output_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
			CompletionTokensDetails struct {
				ReasoningTokens int `json:"reasoning_tokens"`
			} `json:"completion_tokens_details"`
			// The Responses API's names for the same details.
			InputTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
			OutputTokensDetails struct {
				ReasoningTokens int `json:"reasoning_tokens"`
			} `json:"output_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(result, &r) != nil {
		return
	}
	in, out := r.Usage.PromptTokens+r.Usage.InputTokens, r.Usage.CompletionTokens+r.Usage.OutputTokens
	u.InputTokens += in
	u.OutputTokens += out
	u.TotalTokens += in + out
	u.InputTokensDetails.CachedTokens += r.Usage.PromptTokensDetails.CachedTokens + r.Usage.InputTokensDetails.CachedTokens
	u.OutputTokensDetails.ReasoningTokens += r.Usage.CompletionTokensDetails.ReasoningTokens + r.Usage.OutputTokensDetails.ReasoningTokens
}

// fileWriter writes a file's lines to the store in chunks of about
// fileChunk bytes, whole lines each.
type fileWriter struct {
	ctx          context.Context
	st           batchStore
	id           string
	buf          bytes.Buffer
	seq          int
	bytes, lines int64
}

func (fw *fileWriter) add(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	fw.buf.Write(b)
	fw.buf.WriteByte('\n')
	fw.bytes += int64(len(b) + 1)
	fw.lines++
	if fw.buf.Len() >= fileChunk {
		return fw.flush()
	}
	return nil
}

func (fw *fileWriter) flush() error {
	if fw.buf.Len() == 0 {
		return nil
	}
	if err := fw.st.PutFileChunk(fw.ctx, fw.id, fw.seq, fw.buf.Bytes()); err != nil {
		return err
	}
	fw.seq++
	fw.buf.Reset()
	return nil
}

// finalizeBatch writes the output and error files of a batch whose lines
// have all ended (or, for an expired batch, are cancelled first), and ends
// it. It runs under a lease of its own; a finalization that loses it (the
// replica stalled or died) is started over by the next, with new files,
// and only the one that ends the batch makes its files the batch's: no
// line is ever written twice.
func (s *Server) finalizeBatch(ctx context.Context, b store.Batch, end string) error {
	lease := s.batchLease()
	fence, err := s.batches.LeaseBatch(ctx, b.ID, b.Fence, time.Now(), lease)
	if err != nil {
		return err
	}
	if end == "" {
		end = store.BatchCompleted
	}
	if end == store.BatchExpired {
		if _, err := s.batches.CancelBatchLines(ctx, b.ID, true, time.Now()); err != nil {
			return err
		}
	}
	now := time.Now()
	var expires time.Time
	if b.OutputExpiresAfter > 0 {
		expires = now.Add(b.OutputExpiresAfter)
	}
	out := store.File{ID: newObjectID("file-"), Tenant: b.Tenant, Filename: b.ID + "_output.jsonl", Purpose: "batch_output", CreatedAt: now, ExpiresAt: expires}
	errFile := store.File{ID: newObjectID("file-"), Tenant: b.Tenant, Filename: b.ID + "_error.jsonl", Purpose: "batch_output", CreatedAt: now, ExpiresAt: expires}
	if err := s.batches.BeginFinalize(ctx, b.Tenant, b.ID, fence, end, out, errFile, now); err != nil {
		if errors.Is(err, store.ErrBatchOpen) {
			// A line was replayed after the look that sent us here: the
			// batch waits for it, its lease given up for the next poll.
			return s.batches.ReleaseBatch(ctx, b.ID, fence)
		}
		return err
	}
	ow := &fileWriter{ctx: ctx, st: s.batches, id: out.ID}
	ew := &fileWriter{ctx: ctx, st: s.batches, id: errFile.ID}
	var (
		counts store.BatchCounts
		usage  batchUsage
	)
	for after := ""; ; {
		lines, err := s.batches.BatchLines(ctx, b.ID, after, 500)
		if err != nil {
			return err
		}
		if len(lines) == 0 {
			break
		}
		if err := s.batches.RenewBatch(ctx, b.ID, fence, time.Now(), lease); err != nil {
			return err
		}
		for _, l := range lines {
			counts.Total++
			switch l.State {
			case store.Succeeded, store.ReviewRequired:
				counts.Succeeded++
				addUsage(&usage, l.Result)
			case store.Cancelled:
				counts.Cancelled++
			default:
				// A line not ended (the expired batch's cancel raced a
				// completion) is cut as it stands: a failure.
				counts.Failed++
			}
			line, ok := outputLine(l, end)
			w := ew
			if ok {
				w = ow
			}
			if err := w.add(line); err != nil {
				return err
			}
		}
		after = lines[len(lines)-1].JobID
	}
	if err := ow.flush(); err != nil {
		return err
	}
	if err := ew.flush(); err != nil {
		return err
	}
	u, _ := json.Marshal(usage)
	if err := s.batches.EndBatch(ctx, store.BatchEnd{
		ID: b.ID, Tenant: b.Tenant, Fence: fence, Status: end,
		OutputFileID: out.ID, OutputBytes: ow.bytes, OutputLines: ow.lines,
		ErrorFileID: errFile.ID, ErrorBytes: ew.bytes, ErrorLines: ew.lines,
		Counts: counts, Usage: u, Now: time.Now(),
	}); err != nil {
		return err
	}
	if s.jobs.Wake != nil {
		s.jobs.Wake() // the relay: the batch's event
	}
	return nil
}

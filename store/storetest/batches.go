package storetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// ExerciseBatches runs the Files and Batch cases against a store that
// keeps them.
func ExerciseBatches(t *testing.T, newStore func(t *testing.T) store.Store) {
	tests := []struct {
		name string
		fn   func(*testing.T, store.Store, store.Batches)
	}{
		{"FileChunksAndScope", testFileChunks},
		{"FileListAndSweep", testFileList},
		{"BatchLeaseAndLines", testBatchLines},
		{"BatchFinalizeFenced", testBatchFinalize},
		{"BatchLinesInterleave", testBatchInterleave},
		{"BatchCancelEndsClaims", testBatchCancelEndsClaims},
		{"BatchReservationsAtomic", testBatchReservations},
		{"BatchLinesOutlivePrune", testBatchLinesOutlivePrune},
		{"BatchLineReplay", testBatchLineReplay},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t)
			t.Cleanup(func() { _ = s.Close() })
			b, ok := s.(store.Batches)
			if !ok {
				t.Fatalf("%T does not keep files and batches", s)
			}
			tc.fn(t, s, b)
		})
	}
}

func newFile(tenant, id, purpose string, at time.Time) store.File {
	return store.File{ID: id, Tenant: tenant, Filename: id + ".jsonl", Purpose: purpose, CreatedAt: at}
}

func writeFile(t *testing.T, b store.Batches, f store.File, chunks ...string) {
	t.Helper()
	ctx := context.Background()
	if err := b.CreateFile(ctx, f); err != nil {
		t.Fatal(err)
	}
	for i, c := range chunks {
		if err := b.PutFileChunk(ctx, f.ID, i, []byte(c)); err != nil {
			t.Fatal(err)
		}
		f.Bytes += int64(len(c))
	}
	f.Lines = int64(len(chunks))
	if err := b.CompleteFile(ctx, f); err != nil {
		t.Fatal(err)
	}
}

func testFileChunks(t *testing.T, _ store.Store, b store.Batches) {
	ctx := context.Background()
	f := newFile("acme", "file-1", "batch", t0)
	if err := b.CreateFile(ctx, f); err != nil {
		t.Fatal(err)
	}
	for i, c := range []string{"one\n", "two\n", "three\n"} {
		if err := b.PutFileChunk(ctx, f.ID, i, []byte(c)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.File(ctx, "acme", f.ID, t0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("an incomplete file: %v, want not found", err)
	}
	f.Bytes, f.Lines, f.ExpiresAt = 14, 3, t0.Add(time.Hour)
	if err := b.CompleteFile(ctx, f); err != nil {
		t.Fatal(err)
	}
	got, err := b.File(ctx, "acme", f.ID, t0)
	if err != nil || got.Bytes != 14 || got.Lines != 3 || !got.Complete || got.Purpose != "batch" || !got.ExpiresAt.Equal(t0.Add(time.Hour)) {
		t.Fatalf("file: %+v, %v", got, err)
	}
	var all string
	for seq := 0; ; seq++ {
		c, err := b.FileChunk(ctx, f.ID, seq)
		if errors.Is(err, store.ErrNotFound) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		all += string(c)
	}
	if all != "one\ntwo\nthree\n" {
		t.Errorf("content %q", all)
	}
	if _, err := b.File(ctx, "globex", f.ID, t0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's file: %v", err)
	}
	// What the tenant's files hold: this one's 14 bytes, and the chunks
	// written so far of one being written; another tenant's are not
	// counted, nor this one's once expired.
	w := newFile("acme", "file-writing", "user_data", t0)
	if err := b.CreateFile(ctx, w); err != nil {
		t.Fatal(err)
	}
	if err := b.PutFileChunk(ctx, w.ID, 0, []byte("12345")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, b, newFile("globex", "file-g", "user_data", t0), "elsewhere\n")
	if n, err := b.FileBytes(ctx, "acme", t0); err != nil || n != 19 {
		t.Errorf("acme's files hold %d bytes (%v), want 14 + 5", n, err)
	}
	if n, err := b.FileBytes(ctx, "acme", t0.Add(2*time.Hour)); err != nil || n != 5 {
		t.Errorf("acme's files once the complete one expired: %d bytes (%v), want 5", n, err)
	}
	if err := b.DeleteFile(ctx, "acme", w.ID); err != nil {
		t.Fatal(err)
	}
	if err := b.DeleteFile(ctx, "globex", f.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant deleted it: %v", err)
	}
	if _, err := b.File(ctx, "acme", f.ID, t0.Add(time.Hour)); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("an expired file: %v", err)
	}
	if err := b.DeleteFile(ctx, "acme", f.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := b.FileChunk(ctx, f.ID, 0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a deleted file's chunk: %v", err)
	}
	// A second delete (two at once: the later one) finds nothing.
	if err := b.DeleteFile(ctx, "acme", f.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a second delete: %v, want ErrNotFound", err)
	}
}

func testFileList(t *testing.T, _ store.Store, b store.Batches) {
	ctx := context.Background()
	for i := range 5 {
		purpose := "batch"
		if i%2 == 1 {
			purpose = "user_data"
		}
		writeFile(t, b, newFile("acme", fmt.Sprintf("file-%d", i), purpose, t0), "x\n")
	}
	writeFile(t, b, newFile("globex", "file-9", "batch", t0), "x\n")
	if err := b.CreateFile(ctx, newFile("acme", "file-8", "batch", t0)); err != nil { // never completed
		t.Fatal(err)
	}
	ids := func(fs []store.File) (out []string) {
		for _, f := range fs {
			out = append(out, f.ID)
		}
		return out
	}
	fs, more, err := b.ListFiles(ctx, "acme", store.FileFilter{Limit: 2}, t0)
	if err != nil || !more || fmt.Sprint(ids(fs)) != "[file-4 file-3]" {
		t.Errorf("first page: %v more %v, %v", ids(fs), more, err)
	}
	fs, more, _ = b.ListFiles(ctx, "acme", store.FileFilter{Limit: 2, After: "file-1"}, t0)
	if more || fmt.Sprint(ids(fs)) != "[file-0]" {
		t.Errorf("last page: %v more %v", ids(fs), more)
	}
	fs, _, _ = b.ListFiles(ctx, "acme", store.FileFilter{Purpose: "batch", Asc: true, After: "file-0"}, t0)
	if fmt.Sprint(ids(fs)) != "[file-2 file-4]" {
		t.Errorf("batch files after file-0, ascending: %v", ids(fs))
	}
	// The sweep takes files left incomplete (file-8), not the others.
	if n, err := b.SweepFiles(ctx, t0.Add(time.Second), t0, 100); err != nil || n != 1 {
		t.Errorf("swept %d, %v; want the incomplete one", n, err)
	}
	if err := b.DeleteFile(ctx, "acme", "file-8"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the swept file: %v", err)
	}
	fs, _, _ = b.ListFiles(ctx, "acme", store.FileFilter{}, t0)
	if len(fs) != 5 {
		t.Errorf("after the sweep, %d files", len(fs))
	}
}

func newBatch(tenant, id string) store.Batch {
	return store.Batch{ID: id, Tenant: tenant, Endpoint: "/v1/chat/completions", InputFileID: "file-in", CompletionWindow: "24h",
		CreatedAt: t0, ExpiresAt: t0.Add(24 * time.Hour)}
}

func lineJobs(tenant, batch string, n, base int) ([]store.NewJob, []string) {
	var js []store.NewJob
	var cs []string
	for i := range n {
		js = append(js, newJob(tenant, fmt.Sprintf("%s/%d", batch, i), func(j *store.NewJob) {
			j.Priority, j.Metadata = base+i, nil
		}))
		cs = append(cs, fmt.Sprintf("c-%d", i))
	}
	return js, cs
}

// leaseFree takes a batch's lease as the worker does.
func leaseFree(t *testing.T, b store.Batches, id string, now time.Time) int64 {
	t.Helper()
	bs, err := b.BatchesToWork(context.Background(), now, "", 10)
	if err != nil {
		t.Fatal(err)
	}
	for _, bt := range bs {
		if bt.ID == id {
			f, err := b.LeaseBatch(context.Background(), id, bt.Fence, now, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("batch %s is not free to work at %s", id, now)
	return 0
}

func testBatchLines(t *testing.T, s store.Store, b store.Batches) {
	ctx := context.Background()
	if err := b.CreateBatch(ctx, newBatch("acme", "batch_1")); err != nil {
		t.Fatal(err)
	}
	fence := leaseFree(t, b, "batch_1", t0)
	if _, err := b.LeaseBatch(ctx, "batch_1", fence, t0.Add(time.Second), time.Minute); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("a held lease taken again: %v", err)
	}
	if bs, _ := b.BatchesToWork(ctx, t0.Add(time.Second), "", 10); len(bs) != 0 {
		t.Errorf("a leased batch is offered: %v", bs)
	}
	// Paged by id, every free batch once.
	for _, id := range []string{"batch_p1", "batch_p2", "batch_p3"} {
		if err := b.CreateBatch(ctx, newBatch("acme", id)); err != nil {
			t.Fatal(err)
		}
	}
	var paged []string
	for after := ""; ; {
		bs, err := b.BatchesToWork(ctx, t0.Add(time.Second), after, 2)
		if err != nil {
			t.Fatal(err)
		}
		for _, bt := range bs {
			paged = append(paged, bt.ID)
		}
		if len(bs) < 2 {
			break
		}
		after = bs[len(bs)-1].ID
	}
	if !slices.Equal(paged, []string{"batch_p1", "batch_p2", "batch_p3"}) {
		t.Errorf("free batches paged two at a time: %v", paged)
	}
	for _, id := range paged {
		leaseFree(t, b, id, t0.Add(time.Second)) // out of the way of what follows
	}
	js, cs := lineJobs("acme", "batch_1", 10, 1)
	// A stale claim writes nothing.
	if err := b.AcceptBatchLines(ctx, "batch_1", fence-1, js, cs); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("lines under a stale fence: %v", err)
	}
	if c, _ := b.BatchCounts(ctx, "batch_1"); c.Total != 0 {
		t.Errorf("a stale claim wrote %d lines", c.Total)
	}
	for range 2 { // the second time, as a validation retried after a crash
		if err := b.AcceptBatchLines(ctx, "batch_1", fence, js, cs); err != nil {
			t.Fatal(err)
		}
	}
	if c, err := b.BatchCounts(ctx, "batch_1"); err != nil || c != (store.BatchCounts{Total: 10, Open: 10}) {
		t.Errorf("counts %+v, %v", c, err)
	}
	if err := b.StartBatch(ctx, "batch_1", fence, 10, "m", t0); err != nil {
		t.Fatal(err)
	}
	bt, err := b.Batch(ctx, "acme", "batch_1")
	if err != nil || bt.Status != store.BatchInProgress || bt.Total != 10 || bt.Model != "m" || !bt.InProgressAt.Equal(t0) {
		t.Fatalf("started: %+v, %v", bt, err)
	}
	if _, err := b.Batch(ctx, "globex", "batch_1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's batch: %v", err)
	}
	// Lines are jobs: claimed and completed as any.
	claimed, err := s.Claim(ctx, t0, time.Minute, 3)
	if err != nil || len(claimed) != 3 {
		t.Fatalf("claim: %d, %v", len(claimed), err)
	}
	if err := s.Complete(ctx, store.Completion{JobID: claimed[0].ID, Fence: claimed[0].Fence, State: store.Succeeded, Result: []byte(`{"ok":1}`),
		Attempt: store.Attempt{JobID: claimed[0].ID, Attempt: 1, Fence: claimed[0].Fence, Outcome: store.OutcomeSucceeded, Spent: true, Sent: true}, Now: t0}); err != nil {
		t.Fatal(err)
	}
	// Cancel: the queued lines at once, the running ones finish; each
	// line's job.cancelled makes its webhook deliveries.
	hook := endpoint(t, s, "acme", "job.cancelled")
	bt, err = b.CancelBatch(ctx, "acme", "batch_1", t0)
	if err != nil || bt.Status != store.BatchCancelling || !bt.CancellingAt.Equal(t0) {
		t.Fatalf("cancel: %+v, %v", bt, err)
	}
	n, err := b.CancelBatchLines(ctx, "batch_1", false, t0)
	if err != nil || n != 7 {
		t.Errorf("cancelled %d lines, %v; want the 7 queued", n, err)
	}
	if n, _ := b.CancelBatchLines(ctx, "batch_1", false, t0); n != 0 {
		t.Errorf("cancelled %d lines again", n)
	}
	if open, err := b.BatchOpen(ctx, "batch_1"); err != nil || !open {
		t.Errorf("open %v, %v: two lines still run", open, err)
	}
	if c, _ := b.BatchCounts(ctx, "batch_1"); c != (store.BatchCounts{Total: 10, Succeeded: 1, Cancelled: 7, Open: 2}) {
		t.Errorf("counts %+v", c)
	}
	evs, err := s.Unpublished(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	cancelled := 0
	for _, e := range evs {
		if e.Type == "job.cancelled" {
			cancelled++
		}
	}
	if cancelled != 7 {
		t.Errorf("%d job.cancelled events, want 7", cancelled)
	}
	if ds := deliveriesOf(t, s, store.DeliveryFilter{EndpointID: hook.ID}); len(ds) != 7 || ds[0].Type != "job.cancelled" {
		t.Errorf("%d deliveries of the cancelled lines (%+v), want 7", len(ds), ds)
	}
	// One running line had marked its request sent with its usage's
	// reservation (store.Charge): the cancel that takes it charges it.
	if err := s.MarkSent(ctx, claimed[1].ID, claimed[1].Fence, t0, time.Minute, &store.Charge{Tokens: 12, Cost: 6}); err != nil {
		t.Fatal(err)
	}
	if n, _ := b.CancelBatchLines(ctx, "batch_1", true, t0); n != 2 {
		t.Errorf("cancelled %d running lines, want 2", n)
	}
	if got := ledgerOf(usageOn(t, s, "acme", t0)); got != (ledger{requests: 1, attempts: 1, uncertain: 1, uncertainTokens: 12, uncertainCost: 6}) {
		t.Errorf("the ledger after the running lines' cancel: %+v, want the sent line's reservation as uncertain", got)
	}
	if ds := deliveriesOf(t, s, store.DeliveryFilter{EndpointID: hook.ID}); len(ds) != 9 {
		t.Errorf("%d deliveries of the cancelled lines, want 9", len(ds))
	}
	if open, _ := b.BatchOpen(ctx, "batch_1"); open {
		t.Error("lines still open")
	}
	// A batch's lines list as jobs of the batch, newest first, paged.
	if _, _, err := s.Accept(ctx, newJob("acme", "not-a-line")); err != nil {
		t.Fatal(err)
	}
	var lines []store.Job
	for cursor := ""; ; {
		page, next, err := s.List(ctx, "acme", store.ListFilter{Batch: "batch_1", After: cursor, Limit: 4})
		if err != nil {
			t.Fatal(err)
		}
		lines = append(lines, page...)
		if next == "" {
			break
		}
		cursor = next
	}
	if len(lines) != 10 {
		t.Errorf("the batch lists %d jobs, want its 10 lines", len(lines))
	}
	for i := 1; i < len(lines); i++ {
		if lines[i].ID >= lines[i-1].ID {
			t.Errorf("lines out of order: %s before %s", lines[i-1].ID, lines[i].ID)
		}
	}
	if other, _, err := s.List(ctx, "globex", store.ListFilter{Batch: "batch_1"}); err != nil || len(other) != 0 {
		t.Errorf("another tenant lists %d of the batch's lines, %v", len(other), err)
	}
	if none, _, err := s.List(ctx, "acme", store.ListFilter{Batch: "batch_2"}); err != nil || len(none) != 0 {
		t.Errorf("an unknown batch lists %d jobs, %v", len(none), err)
	}
}

func testBatchFinalize(t *testing.T, s store.Store, b store.Batches) {
	ctx := context.Background()
	hook := endpoint(t, s, "acme", "batch.completed")
	if err := b.CreateBatch(ctx, newBatch("acme", "batch_f")); err != nil {
		t.Fatal(err)
	}
	fence := leaseFree(t, b, "batch_f", t0)
	js, cs := lineJobs("acme", "batch_f", 3, 1)
	if err := b.AcceptBatchLines(ctx, "batch_f", fence, js, cs); err != nil {
		t.Fatal(err)
	}
	if err := b.StartBatch(ctx, "batch_f", fence, 3, "m", t0); err != nil {
		t.Fatal(err)
	}
	// No finalization begins while a line is open: the batch stays in
	// progress, no file made.
	now := t0.Add(time.Minute)
	f0 := leaseFree(t, b, "batch_f", now)
	out0, err0 := newFile("acme", "file-o0", "batch_output", now), newFile("acme", "file-e0", "batch_output", now)
	if err := b.BeginFinalize(ctx, "acme", "batch_f", f0, store.BatchCompleted, out0, err0, now); !errors.Is(err, store.ErrBatchOpen) {
		t.Fatalf("finalize a batch with its lines open: %v, want ErrBatchOpen", err)
	}
	if bt, err := b.Batch(ctx, "acme", "batch_f"); err != nil || bt.Status != store.BatchInProgress || bt.EndStatus != "" {
		t.Fatalf("after a refused finalization: %+v, %v", bt, err)
	}
	if _, err := b.File(ctx, "acme", out0.ID, now); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a refused finalization made its output file: %v", err)
	}
	if err := b.ReleaseBatch(ctx, "batch_f", f0); err != nil {
		t.Fatal(err)
	}
	if n, err := b.CancelBatchLines(ctx, "batch_f", true, now); err != nil || n != 3 {
		t.Fatalf("cancelled %d lines, %v", n, err)
	}
	// A first finalizer begins, writes, and loses its lease.
	f1 := leaseFree(t, b, "batch_f", now)
	out1, err1 := newFile("acme", "file-o1", "batch_output", now), newFile("acme", "file-e1", "batch_output", now)
	if err := b.BeginFinalize(ctx, "acme", "batch_f", f1, store.BatchCompleted, out1, err1, now); err != nil {
		t.Fatal(err)
	}
	if err := b.PutFileChunk(ctx, out1.ID, 0, []byte("half\n")); err != nil {
		t.Fatal(err)
	}
	later := now.Add(2 * time.Minute)
	f2 := leaseFree(t, b, "batch_f", later)
	out2, err2 := newFile("acme", "file-o2", "batch_output", later), newFile("acme", "file-e2", "batch_output", later)
	if err := b.BeginFinalize(ctx, "acme", "batch_f", f2, store.BatchExpired, out2, err2, later); err != nil {
		t.Fatal(err)
	}
	if _, err := b.FileChunk(ctx, out1.ID, 0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the first finalizer's file survived the second's start: %v", err)
	}
	lines, err := b.BatchLines(ctx, "batch_f", "", 10)
	if err != nil || len(lines) != 3 || lines[0].CustomID != "c-0" || lines[0].State != store.Cancelled {
		t.Fatalf("lines %+v, %v", lines, err)
	}
	if more, _ := b.BatchLines(ctx, "batch_f", lines[2].JobID, 10); len(more) != 0 {
		t.Errorf("lines after the last: %v", more)
	}
	if err := b.PutFileChunk(ctx, out2.ID, 0, []byte("a\nb\n")); err != nil {
		t.Fatal(err)
	}
	end := store.BatchEnd{ID: "batch_f", Fence: f1, Status: store.BatchCompleted, OutputBytes: 5, OutputLines: 1,
		Counts: store.BatchCounts{Total: 3, Succeeded: 1, Failed: 2}, Now: later}
	if err := b.EndBatch(ctx, end); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("the first finalizer ended the batch: %v", err)
	}
	end.Fence, end.OutputBytes, end.OutputLines, end.Counts = f2, 4, 2, store.BatchCounts{Total: 3, Succeeded: 2, Cancelled: 1}
	if err := b.EndBatch(ctx, end); err != nil {
		t.Fatal(err)
	}
	bt, err := b.Batch(ctx, "acme", "batch_f")
	if err != nil || bt.Status != store.BatchCompleted || bt.OutputFileID != out2.ID || bt.ErrorFileID != "" ||
		bt.Completed != 2 || bt.Failed != 1 || bt.Total != 3 || !bt.CompletedAt.Equal(later) || bt.EndStatus != store.BatchCompleted { // the first finalizer set where it ends
		t.Fatalf("ended: %+v, %v", bt, err)
	}
	if f, err := b.File(ctx, "acme", out2.ID, later); err != nil || f.Bytes != 4 || f.Lines != 2 {
		t.Errorf("output file: %+v, %v", f, err)
	}
	if _, err := b.File(ctx, "acme", err2.ID, later); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("an empty error file is kept: %v", err)
	}
	evs, _ := s.Unpublished(ctx, 100)
	n := 0
	for _, e := range evs {
		if e.Type == "batch.completed" && e.JobID == "batch_f" && e.Tenant == "acme" {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d batch.completed events", n)
	}
	// The batch's event reaches an endpoint that subscribes to it, in the
	// transaction that committed it.
	if ds := deliveriesOf(t, s, store.DeliveryFilter{Tenant: "acme", EndpointID: hook.ID}); len(ds) != 1 ||
		ds[0].Type != "batch.completed" || ds[0].JobID != "batch_f" || ds[0].State != store.DeliveryPending {
		t.Errorf("deliveries of batch.completed: %+v", ds)
	}
	if _, err := b.CancelBatch(ctx, "acme", "batch_f", later); !errors.Is(err, store.ErrFinal) {
		t.Errorf("cancel an ended batch: %v", err)
	}
}

// testBatchLinesInterleave: a tenant's second batch starts at the line its
// first has reached (BatchPriorityBase), and the claims then take the two
// in turn; the tenant's own jobs go first.
func testBatchInterleave(t *testing.T, s store.Store, b store.Batches) {
	ctx := context.Background()
	add := func(id string, n int) {
		t.Helper()
		if err := b.CreateBatch(ctx, newBatch("acme", id)); err != nil {
			t.Fatal(err)
		}
		fence := leaseFree(t, b, id, t0)
		base, err := b.BatchPriorityBase(ctx, "acme")
		if err != nil {
			t.Fatal(err)
		}
		js, cs := lineJobs("acme", id, n, base)
		if err := b.AcceptBatchLines(ctx, id, fence, js, cs); err != nil {
			t.Fatal(err)
		}
		if err := b.StartBatch(ctx, id, fence, n, "m", t0); err != nil {
			t.Fatal(err)
		}
	}
	add("batch_big", 100)
	first, err := s.Claim(ctx, t0, time.Minute, 10) // the big one runs alone for a while
	if err != nil || len(first) != 10 {
		t.Fatalf("claim: %d, %v", len(first), err)
	}
	if base, _ := b.BatchPriorityBase(ctx, "acme"); base != 11 {
		t.Errorf("the next batch starts at %d, want 11", base)
	}
	add("batch_small", 5)
	own := accept(t, s, newJob("acme", "own"))
	got, err := s.Claim(ctx, t0, time.Minute, 11)
	if err != nil || len(got) != 11 {
		t.Fatalf("claim: %d, %v", len(got), err)
	}
	if got[0].ID != own.ID {
		t.Errorf("the tenant's own job is not first: %v", got[0].IdempotencyKey)
	}
	small := 0
	for _, j := range got[1:] {
		if j.IdempotencyKey[:len("batch_small")] == "batch_small" {
			small++
		}
	}
	if small != 5 {
		t.Errorf("the small batch got %d of the 10 turns after the big one's 10: want all its 5, in turn", small)
	}
}

// testBatchCancelEndsClaims: a cancel during validation ends the
// validator's claim: its further lines and its start are refused.
func testBatchCancelEndsClaims(t *testing.T, _ store.Store, b store.Batches) {
	ctx := context.Background()
	if err := b.CreateBatch(ctx, newBatch("acme", "batch_c")); err != nil {
		t.Fatal(err)
	}
	fence := leaseFree(t, b, "batch_c", t0)
	js, cs := lineJobs("acme", "batch_c", 4, 1)
	if err := b.AcceptBatchLines(ctx, "batch_c", fence, js[:2], cs[:2]); err != nil {
		t.Fatal(err)
	}
	if _, err := b.CancelBatch(ctx, "acme", "batch_c", t0); err != nil {
		t.Fatal(err)
	}
	if err := b.AcceptBatchLines(ctx, "batch_c", fence, js[2:], cs[2:]); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("lines after the cancel: %v", err)
	}
	if err := b.StartBatch(ctx, "batch_c", fence, 4, "m", t0); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("start after the cancel: %v", err)
	}
	if c, _ := b.BatchCounts(ctx, "batch_c"); c.Total != 2 {
		t.Errorf("%d lines, want the 2 accepted before the cancel", c.Total)
	}
}

// testBatchReservations: a batch's lines are reserved under the tenant's
// pending-job limits by one reservation, checked and held in one
// transaction: of batches reserved at once, only those that fit together
// get room; a reservation counts its lines against single jobs too, is
// replaced when reserved again under its id, and ends with
// EndJobReservation or its lease.
func testBatchReservations(t *testing.T, s store.Store, b store.Batches) {
	ctx := context.Background()
	l := store.Limits{MaxPendingJobs: 100, MaxPendingTokens: 1_000_000}
	accept(t, s, newJob("acme", "k1")) // one job pending
	// Eight batches of 30 lines at once: three fit beside the job.
	const callers = 8
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		admitted []string
		refused  int
		other    []error
	)
	for i := range callers {
		wg.Go(func() {
			id := fmt.Sprintf("batch:b%d", i)
			err := b.ReserveBatch(ctx, id, "acme", 30, 300, l, t0, time.Minute)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				admitted = append(admitted, id)
			case quotaLimit(err) == "pending_jobs":
				refused++
			default:
				other = append(other, err)
			}
		})
	}
	wg.Wait()
	if len(admitted) != 3 || refused != callers-3 || len(other) > 0 {
		t.Fatalf("%d batches of 30 against 99 free: %d reserved, %d refused, errors %v", callers, len(admitted), refused, other)
	}
	// 91 pending now: a single job fits, a batch of 10 does not.
	if err := b.ReserveBatch(ctx, "batch:late", "acme", 10, 10, l, t0, time.Minute); quotaLimit(err) != "pending_jobs" {
		t.Fatalf("a batch past the limit: %v, want pending_jobs", err)
	}
	if err := s.ReserveJob(ctx, "r1", "acme", 1, l, t0, time.Minute); err != nil {
		t.Fatalf("a job beside the reserved batches: %v", err)
	}
	// Reserved again under its id (a takeover), a batch replaces its
	// own reservation rather than counting twice.
	if err := b.ReserveBatch(ctx, admitted[0], "acme", 38, 300, l, t0, time.Minute); err != nil {
		t.Fatalf("a batch reserved again: %v", err)
	}
	if err := s.ReserveJob(ctx, "r2", "acme", 1, l, t0, time.Minute); quotaLimit(err) != "pending_jobs" {
		t.Fatalf("a job past the limit: %v, want pending_jobs", err)
	}
	// Tokens count as well.
	if err := b.ReserveBatch(ctx, "batch:tokens", "globex", 1, 1_000_001, l, t0, time.Minute); quotaLimit(err) != "pending_tokens" {
		t.Fatalf("a batch past the pending tokens: %v, want pending_tokens", err)
	}
	// Ended, its room is free again; a lapsed lease frees it too.
	if err := s.EndJobReservation(ctx, admitted[1]); err != nil {
		t.Fatal(err)
	}
	if err := b.ReserveBatch(ctx, "batch:after-end", "acme", 30, 300, l, t0, time.Minute); err != nil {
		t.Fatalf("after a batch's reservation ended: %v", err)
	}
	if err := b.ReserveBatch(ctx, "batch:after-lease", "acme", 99, 300, l, t0.Add(2*time.Minute), time.Minute); err != nil {
		t.Fatalf("after the reservations' leases: %v", err)
	}
}

// testBatchLinesOutlivePrune: the retention prune keeps the ended lines of
// a batch not yet ended, however old: its files are written from them,
// and their keys keep a validation taken over from accepting them again.
// Once the batch ends, they go.
func testBatchLinesOutlivePrune(t *testing.T, s store.Store, b store.Batches) {
	ctx := context.Background()
	if err := b.CreateBatch(ctx, newBatch("acme", "batch_r")); err != nil {
		t.Fatal(err)
	}
	fence := leaseFree(t, b, "batch_r", t0)
	js, cs := lineJobs("acme", "batch_r", 3, 1)
	if err := b.AcceptBatchLines(ctx, "batch_r", fence, js, cs); err != nil {
		t.Fatal(err)
	}
	if n, err := b.CancelBatchLines(ctx, "batch_r", true, t0); err != nil || n != 3 {
		t.Fatalf("cancelled %d lines (%v), want 3", n, err)
	}
	publishAll(t, s, t0)
	if n, err := s.PruneFinal(ctx, t0.Add(48*time.Hour), 100); err != nil || n != 0 {
		t.Errorf("the prune took %d lines of an open batch (%v), want none", n, err)
	}
	if c, _ := b.BatchCounts(ctx, "batch_r"); c.Total != 3 {
		t.Errorf("the open batch has %d lines after the prune, want 3", c.Total)
	}
	if err := b.FailBatch(ctx, "acme", "batch_r", fence, []byte(`[]`), 3, "", t0); err != nil {
		t.Fatal(err)
	}
	accept(t, s, newJob("acme", "later")) // its event, not a line's, holds the feed's last place (kept)
	publishAll(t, s, t0)
	batchEvents := func() int {
		evs, err := s.Events(ctx, "acme", "batch_r", 0, 10)
		if err != nil {
			t.Fatal(err)
		}
		return len(evs)
	}
	if n := batchEvents(); n != 1 {
		t.Fatalf("the ended batch has %d events in the feed, want its batch.failed", n)
	}
	if n, err := s.PruneFinal(ctx, t0, 100); err != nil || n != 0 || batchEvents() != 1 {
		t.Errorf("a prune of what is older than the batch's end took %d lines (%v) and left %d of its events, want 0 and 1", n, err, batchEvents())
	}
	if n, err := s.PruneFinal(ctx, t0.Add(48*time.Hour), 100); err != nil || n != 3 {
		t.Errorf("the prune took %d lines of the ended batch (%v), want 3", n, err)
	}
	if n := batchEvents(); n != 0 {
		t.Errorf("the ended batch's event outlived its retention: %d left", n)
	}
	if _, err := b.Batch(ctx, "acme", "batch_r"); err != nil {
		t.Errorf("the prune took the batch: %v", err)
	}
}

// testBatchLineReplay: a failed line may be replayed while its batch is
// in progress; once the batch is no longer (its files written, or being
// written, from the line as it ended), a replay is refused, the line kept.
func testBatchLineReplay(t *testing.T, s store.Store, b store.Batches) {
	ctx := context.Background()
	if err := b.CreateBatch(ctx, newBatch("acme", "batch_x")); err != nil {
		t.Fatal(err)
	}
	fence := leaseFree(t, b, "batch_x", t0)
	js, cs := lineJobs("acme", "batch_x", 2, 1)
	if err := b.AcceptBatchLines(ctx, "batch_x", fence, js, cs); err != nil {
		t.Fatal(err)
	}
	if err := b.StartBatch(ctx, "batch_x", fence, 2, "m", t0); err != nil {
		t.Fatal(err)
	}
	failed := func() []store.Job { // both lines claimed, and failed for good
		claimed, err := s.Claim(ctx, t0, time.Minute, 10)
		if err != nil {
			t.Fatal(err)
		}
		for _, j := range claimed {
			if err := s.Fail(ctx, store.Failure{JobID: j.ID, Fence: j.Fence, Now: t0, Attempt: store.Attempt{JobID: j.ID, Attempt: 1, Fence: j.Fence,
				Outcome: store.OutcomeFailed, Spent: true, ErrorClass: "invalid", StartedAt: t0, EndedAt: t0}}); err != nil {
				t.Fatal(err)
			}
		}
		return claimed
	}()
	if len(failed) != 2 {
		t.Fatalf("claimed %d lines, want 2", len(failed))
	}
	replay := func(id string) error {
		_, err := s.Replay(ctx, store.Replay{Tenant: "acme", JobID: id, MaxAttempts: 3, Deadline: t0.Add(time.Hour), Now: t0})
		return err
	}
	// The worker saw every line ended; a replay commits before its
	// finalization begins, which then waits for the line.
	fin := leaseFree(t, b, "batch_x", t0.Add(2*time.Minute))
	if err := replay(failed[0].ID); err != nil {
		t.Errorf("replay a line of a batch in progress: %v", err)
	}
	out, errf := newFile("acme", "file-o", "batch_output", t0), newFile("acme", "file-e", "batch_output", t0)
	if err := b.BeginFinalize(ctx, "acme", "batch_x", fin, store.BatchCompleted, out, errf, t0); !errors.Is(err, store.ErrBatchOpen) {
		t.Errorf("finalize past a replayed line: %v, want ErrBatchOpen", err)
	}
	if err := b.ReleaseBatch(ctx, "batch_x", fin); err != nil {
		t.Fatal(err)
	}
	if _, err := b.CancelBatch(ctx, "acme", "batch_x", t0); err != nil {
		t.Fatal(err)
	}
	if err := replay(failed[1].ID); !errors.Is(err, store.ErrBatchClosed) {
		t.Errorf("replay a line of a batch being cancelled: %v, want ErrBatchClosed", err)
	}
	if j, _ := s.Get(ctx, "acme", failed[1].ID); j.State != store.FailedTerminal {
		t.Errorf("the refused replay's line is %s, want FAILED_TERMINAL still", j.State)
	}
}

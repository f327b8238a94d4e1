package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"time"
)

// submitBatch sends a tenant's requests as one batch of OpenAI's Batch
// API (POST /v1/files, then /v1/batches), follows the batch by polling
// until it ends, and fills each request's record from the output and
// error files: a line's latency is the batch's, from its submission to
// its end (the API says no more of a line).
func (r *requester) submitBatch(ctx context.Context, key string, items []item, ignoreEOS bool, start time.Time, recs []Record) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	failAll := func(class string, status int, msg string) {
		for i := range recs {
			recs[i].E2EL = time.Since(start)
			recs[i].fail(class, status, msg)
		}
	}
	var in bytes.Buffer
	for i, it := range items {
		line, _ := json.Marshal(struct {
			CustomID string          `json:"custom_id"`
			Method   string          `json:"method"`
			URL      string          `json:"url"`
			Body     json.RawMessage `json:"body"`
		}{fmt.Sprint(i), http.MethodPost, r.path(), r.body(it, ignoreEOS, false)})
		in.Write(line)
		in.WriteByte('\n')
	}
	for i := range recs {
		recs[i].Sent = time.Since(start) + recs[i].Intended
	}
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", "bench.jsonl")
	_, _ = fw.Write(in.Bytes())
	_ = mw.WriteField("purpose", "batch")
	_ = mw.Close()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.base+"/v1/files", &body)
	if err != nil {
		failAll(ErrTransport, 0, err.Error())
		return
	}
	req.Header.Set("Content-Type", mw.FormDataContentType())
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		failAll(ErrTransport, 0, err.Error())
		return
	}
	var file struct {
		ID string `json:"id"`
	}
	err = json.NewDecoder(resp.Body).Decode(&file)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || err != nil {
		failAll(classify(resp.StatusCode), resp.StatusCode, "file upload refused")
		return
	}
	type batchView struct {
		ID           string `json:"id"`
		Status       string `json:"status"`
		OutputFileID string `json:"output_file_id"`
		ErrorFileID  string `json:"error_file_id"`
	}
	var b batchView
	create, _ := json.Marshal(map[string]string{"input_file_id": file.ID, "endpoint": r.path(), "completion_window": "24h"})
	if status, err := r.jsonCall(ctx, http.MethodPost, "/v1/batches", key, "", create, &b); err != nil || status != http.StatusOK {
		failAll(classify(status), status, "batch refused")
		return
	}
	tick := time.NewTicker(r.pollEvery)
	defer tick.Stop()
	for b.Status != "completed" && b.Status != "failed" && b.Status != "expired" && b.Status != "cancelled" {
		select {
		case <-ctx.Done():
			for i := range recs {
				recs[i].E2EL = time.Since(start)
				recs[i].failErr(ctx, ctx.Err())
			}
			return
		case <-tick.C:
		}
		id := b.ID
		if status, err := r.jsonCall(ctx, http.MethodGet, "/v1/batches/"+id, key, "", nil, &b); err != nil || status != http.StatusOK {
			b.ID, b.Status = id, "" // a poll lost: look again
		}
	}
	end := time.Since(start)
	for i := range recs {
		recs[i].E2EL = end - recs[i].Intended
		recs[i].fail(ErrJob, 0, "no line in the batch's output or error file (the batch "+b.Status+")")
	}
	for _, fid := range []string{b.OutputFileID, b.ErrorFileID} {
		if fid == "" {
			continue
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.base+"/v1/files/"+fid+"/content", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := r.client.Do(req)
		if err != nil {
			continue
		}
		readBatchOutput(resp.Body, recs)
		resp.Body.Close()
	}
}

// readBatchOutput fills records from a batch's output or error file.
func readBatchOutput(body io.Reader, recs []Record) {
	sc := bufio.NewScanner(body)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		var l struct {
			CustomID string `json:"custom_id"`
			Response *struct {
				StatusCode int `json:"status_code"`
				Body       struct {
					Usage *usage `json:"usage"`
				} `json:"body"`
			} `json:"response"`
			Error *struct {
				Code    string `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		var i int
		if json.Unmarshal(sc.Bytes(), &l) != nil || func() bool { _, err := fmt.Sscan(l.CustomID, &i); return err != nil }() || i < 0 || i >= len(recs) {
			continue
		}
		rec := &recs[i]
		switch {
		case l.Response != nil && l.Response.StatusCode == http.StatusOK:
			rec.ErrorClass, rec.Error, rec.Status = "", "", http.StatusOK
			if u := l.Response.Body.Usage; u != nil {
				rec.InputTokens, rec.OutputTokens = u.PromptTokens, u.CompletionTokens
			}
		case l.Response != nil:
			rec.fail(classify(l.Response.StatusCode), l.Response.StatusCode, "the batch line's request was refused")
		case l.Error != nil:
			rec.fail(ErrJob, 0, l.Error.Code+": "+l.Error.Message)
		}
	}
}

// batch runs a tenant whose requests go as one batch (Tenant.Batch): n of
// them, submitted together at the point's start.
func (p *point) batch(ctx context.Context, t Tenant, src *source, n int) {
	if n <= 0 {
		return
	}
	items := make([]item, n)
	recs := make([]Record, n)
	for i := range items {
		items[i] = src.draw()
		recs[i] = Record{Tenant: t.Name, Point: p.index}
		p.prog.sent()
	}
	p.rq.submitBatch(ctx, t.APIKey, items, t.Workload.IgnoreEOS, p.start, recs)
	for i := range recs {
		if recs[i].ErrorClass == "" && recs[i].InputTokens == 0 {
			recs[i].InputTokens = items[i].inputLen
		}
		end := int64(recs[i].Intended + recs[i].E2EL)
		for {
			old := p.lastEnd.Load()
			if end <= old || p.lastEnd.CompareAndSwap(old, end) {
				break
			}
		}
		p.prog.done(recs[i].ErrorClass != "")
	}
	p.mu.Lock()
	p.recs = append(p.recs, recs...)
	p.mu.Unlock()
}

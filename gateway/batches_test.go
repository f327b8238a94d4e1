package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// upload posts a file to /v1/files as the SDKs do (multipart: file, then
// purpose) and returns the status and body.
func upload(t *testing.T, base, key, name, purpose string, content []byte, extra ...string) (int, []byte) {
	t.Helper()
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", name)
	fw.Write(content)
	if purpose != "" {
		mw.WriteField("purpose", purpose)
	}
	for i := 0; i+1 < len(extra); i += 2 {
		mw.WriteField(extra[i], extra[i+1])
	}
	mw.Close()
	return bsendMultipart(t, base+"/v1/files", key, &body, mw.FormDataContentType())
}

// bsendMultipart posts a multipart body and returns the status and body.
func bsendMultipart(t *testing.T, url, key string, body io.Reader, contentType string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, body)
	req.Header.Set("Content-Type", contentType)
	return bdo(t, req, key)
}

// bdo sends req with key (none when empty) and returns the status and body.
func bdo(t *testing.T, req *http.Request, key string) (int, []byte) {
	t.Helper()
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// bsend sends a JSON request and returns the status and body.
func bsend(t *testing.T, method, url, key, body string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, _ := http.NewRequest(method, url, rd)
	req.Header.Set("Content-Type", "application/json")
	return bdo(t, req, key)
}

// batchLines builds an input file of n chat lines; bad(i) may replace a
// line's body.
func batchLines(n int, body func(i int) string) []byte {
	var b bytes.Buffer
	for i := range n {
		bd := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"line %d"}],"max_tokens":3}`, llama, i)
		if body != nil {
			if s := body(i); s != "" {
				bd = s
			}
		}
		fmt.Fprintf(&b, `{"custom_id":"req-%d","method":"POST","url":"/v1/chat/completions","body":%s}`+"\n", i, bd)
	}
	return b.Bytes()
}

func uploadBatchFile(t *testing.T, base, key string, content []byte) string {
	t.Helper()
	status, b := upload(t, base, key, "input.jsonl", "batch", content)
	if status != http.StatusOK {
		t.Fatalf("upload: %d %s", status, b)
	}
	return decode[fileView](t, b).ID
}

func createBatch(t *testing.T, base, key, fileID string) batchView {
	t.Helper()
	status, b := bsend(t, http.MethodPost, base+"/v1/batches", key,
		fmt.Sprintf(`{"input_file_id":%q,"endpoint":"/v1/chat/completions","completion_window":"24h","metadata":{"run":"test"}}`, fileID))
	if status != http.StatusOK {
		t.Fatalf("create batch: %d %s", status, b)
	}
	v := decode[batchView](t, b)
	if v.Status != store.BatchValidating || v.Object != "batch" || v.ExpiresAt == nil {
		t.Fatalf("created batch: %s", b)
	}
	return v
}

func waitBatch(t *testing.T, base, key, id string, final ...string) batchView {
	t.Helper()
	var v batchView
	eventually.Within(t, 60*time.Second, "batch "+id+" ends", func() bool {
		status, b := bsend(t, http.MethodGet, base+"/v1/batches/"+id, key, "")
		if status != http.StatusOK {
			t.Fatalf("get batch: %d %s", status, b)
		}
		v = decode[batchView](t, b)
		return store.BatchFinal(v.Status)
	})
	if len(final) > 0 && v.Status != final[0] {
		t.Fatalf("batch %s ended %s, want %s: %+v", id, v.Status, final[0], v)
	}
	return v
}

// outputFile downloads a file and parses its lines by custom_id.
func outputFile(t *testing.T, base, key string, id *string) map[string]batchOutput {
	t.Helper()
	out := map[string]batchOutput{}
	if id == nil {
		return out
	}
	status, b := bsend(t, http.MethodGet, base+"/v1/files/"+*id+"/content", key, "")
	if status != http.StatusOK {
		t.Fatalf("file content: %d %s", status, b)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var o batchOutput
		if err := json.Unmarshal(sc.Bytes(), &o); err != nil {
			t.Fatalf("output line %q: %v", sc.Text(), err)
		}
		if _, dup := out[o.CustomID]; dup {
			t.Errorf("custom_id %s appears twice in file %s", o.CustomID, *id)
		}
		out[o.CustomID] = o
	}
	return out
}

func TestFilesAPI(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	acme := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	globex := newTenant(t, st, "globex", store.Limits{}, store.RoleUser)
	base := f.srv.URL

	// Content of more than one chunk comes back byte for byte.
	content := batchLines(4000, nil) // ~600 KB
	content = append(content, batchLines(4000, nil)...)
	status, b := upload(t, base, acme, "big.jsonl", "batch", content, "expires_after[anchor]", "created_at", "expires_after[seconds]", "3600")
	if status != http.StatusOK {
		t.Fatalf("upload: %d %s", status, b)
	}
	big := decode[fileView](t, b)
	if big.Bytes != int64(len(content)) || big.Purpose != "batch" || big.Filename != "big.jsonl" || big.ExpiresAt == nil ||
		*big.ExpiresAt-big.CreatedAt != 3600 || !strings.HasPrefix(big.ID, "file-") || big.Status != "processed" {
		t.Fatalf("file object: %s", b)
	}
	// Without expires_after a batch file expires after 30 days, as
	// OpenAI's; any other file stays.
	status, b = upload(t, base, acme, "month.jsonl", "batch", batchLines(1, nil))
	if month := decode[fileView](t, b); status != http.StatusOK || month.ExpiresAt == nil || *month.ExpiresAt-month.CreatedAt != 30*24*3600 {
		t.Errorf("a batch file without expires_after: %d %s", status, b)
	} else if status, _ := bsend(t, http.MethodDelete, base+"/v1/files/"+month.ID, acme, ""); status != http.StatusOK {
		t.Errorf("delete: %d", status)
	}
	if status, got := bsend(t, http.MethodGet, base+"/v1/files/"+big.ID+"/content", acme, ""); status != http.StatusOK || !bytes.Equal(got, content) {
		t.Fatalf("content: %d, %d bytes back of %d", status, len(got), len(content))
	}
	// Another tenant's file is not found, whatever is asked of it.
	for _, p := range []string{"", "/content"} {
		if status, b := bsend(t, http.MethodGet, base+"/v1/files/"+big.ID+p, globex, ""); status != http.StatusNotFound {
			t.Errorf("globex GET %s: %d %s", p, status, b)
		}
	}
	if status, _ := bsend(t, http.MethodDelete, base+"/v1/files/"+big.ID, globex, ""); status != http.StatusNotFound {
		t.Errorf("globex DELETE: %d", status)
	}

	// Paging: newest first by default, after a cursor, ascending, by purpose.
	var ids []string
	for i := range 3 {
		status, b := upload(t, base, acme, fmt.Sprintf("notes%d.txt", i), "user_data", []byte("hello\n"))
		if status != http.StatusOK {
			t.Fatalf("upload: %d %s", status, b)
		}
		ids = append(ids, decode[fileView](t, b).ID)
	}
	list := func(q string) cursorPage[fileView] {
		status, b := bsend(t, http.MethodGet, base+"/v1/files"+q, acme, "")
		if status != http.StatusOK {
			t.Fatalf("list %s: %d %s", q, status, b)
		}
		return decode[cursorPage[fileView]](t, b)
	}
	p := list("?limit=2")
	if len(p.Data) != 2 || !p.HasMore || p.Data[0].ID != ids[2] || *p.LastID != ids[1] {
		t.Errorf("first page: %+v", p)
	}
	p = list("?limit=2&after=" + *p.LastID)
	if len(p.Data) != 2 || p.HasMore || p.Data[0].ID != ids[0] || p.Data[1].ID != big.ID {
		t.Errorf("second page: %+v", p)
	}
	if p = list("?order=asc&purpose=user_data"); len(p.Data) != 3 || p.Data[0].ID != ids[0] {
		t.Errorf("ascending user_data: %+v", p)
	}
	if p = list("?purpose=batch"); len(p.Data) != 1 || p.Data[0].ID != big.ID {
		t.Errorf("batch files: %+v", p)
	}
	status, b = bsend(t, http.MethodGet, base+"/v1/files", globex, "")
	if status != http.StatusOK || strings.Contains(string(b), big.ID) {
		t.Errorf("globex's list shows acme's files: %s", b)
	}

	// Refusals are OpenAI-shaped and leave no file behind.
	for _, c := range []struct {
		name, file, purpose string
		content             []byte
		status              int
	}{
		{"not jsonl", "in.txt", "batch", []byte("{}\n"), http.StatusBadRequest},
		{"no purpose", "in.jsonl", "", []byte("{}\n"), http.StatusBadRequest},
		{"unknown purpose", "in.jsonl", "nonsense", []byte("{}\n"), http.StatusBadRequest},
		{"too many lines", "in.jsonl", "batch", bytes.Repeat([]byte("{}\n"), maxBatchFileLines+1), http.StatusBadRequest},
	} {
		status, b := upload(t, base, acme, c.file, c.purpose, c.content)
		var eb errorBody
		if status != c.status || json.Unmarshal(b, &eb) != nil || eb.Error.Message == "" || eb.Error.Type != "invalid_request_error" {
			t.Errorf("%s: %d %s", c.name, status, b)
		}
	}
	// A body cut short inside the file's part, whole by its length but
	// without the part's closing boundary (what a client that died
	// mid-upload leaves), is refused: its file may be missing its end.
	// (A body cut after the file's part ended keeps a whole file.)
	for _, c := range []struct {
		name string
		cut  func(mw *multipart.Writer)
	}{
		{"purpose first", func(mw *multipart.Writer) {
			mw.WriteField("purpose", "batch")
			fw, _ := mw.CreateFormFile("file", "cut.jsonl")
			fw.Write(batchLines(50, nil))
		}},
		{"file only", func(mw *multipart.Writer) {
			fw, _ := mw.CreateFormFile("file", "cut.jsonl")
			fw.Write(batchLines(50, nil))
		}},
	} {
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		c.cut(mw) // no Close: the body ends where the writer stopped
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/files", &body)
		req.Header.Set("Content-Type", mw.FormDataContentType())
		req.Header.Set("Authorization", "Bearer "+acme)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var eb errorBody
		if resp.StatusCode != http.StatusBadRequest || json.Unmarshal(b, &eb) != nil || eb.Error.Type != "invalid_request_error" {
			t.Errorf("%s: %d %s", c.name, resp.StatusCode, b)
		}
	}
	// A name no store holds as text, a purpose refused before the file
	// is stored, a path or cursor that names no file.
	for _, c := range []struct{ name, disposition, purpose string }{
		{"a control character", `form-data; name="file"; filename*=UTF-8''a%01b.jsonl`, "batch"},
		{"NUL", `form-data; name="file"; filename*=UTF-8''a%00b.jsonl`, "batch"},
		{"purpose first, unknown", `form-data; name="file"; filename="in.jsonl"`, "nonsense"},
	} {
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		mw.WriteField("purpose", c.purpose)
		pw, _ := mw.CreatePart(textproto.MIMEHeader{"Content-Disposition": {c.disposition}, "Content-Type": {"application/octet-stream"}})
		pw.Write(batchLines(3, nil))
		mw.Close()
		status, b := bsendMultipart(t, base+"/v1/files", acme, &body, mw.FormDataContentType())
		var eb errorBody
		if status != http.StatusBadRequest || json.Unmarshal(b, &eb) != nil || eb.Error.Type != "invalid_request_error" {
			t.Errorf("%s: %d %s", c.name, status, b)
		}
	}
	if status, b := bsend(t, http.MethodGet, base+"/v1/files/file-%FF", acme, ""); status != http.StatusNotFound {
		t.Errorf("a path that is not UTF-8: %d %s", status, b)
	}
	if status, b := bsend(t, http.MethodGet, base+"/v1/files?after=%00", acme, ""); status != http.StatusBadRequest || !strings.Contains(string(b), `"param":"after"`) {
		t.Errorf("a NUL cursor: %d %s", status, b)
	}
	var incomplete int
	if err := st.DB().QueryRow(`SELECT count(*) FROM files`).Scan(&incomplete); err != nil || incomplete != 4 {
		t.Errorf("files kept after the refusals: %d (%v), want the 4 uploaded", incomplete, err)
	}

	// Deleted, it is gone with its content.
	status, b = bsend(t, http.MethodDelete, base+"/v1/files/"+big.ID, acme, "")
	if status != http.StatusOK || !strings.Contains(string(b), `"deleted":true`) {
		t.Fatalf("delete: %d %s", status, b)
	}
	if status, _ := bsend(t, http.MethodGet, base+"/v1/files/"+big.ID, acme, ""); status != http.StatusNotFound {
		t.Errorf("deleted file: %d", status)
	}
	var chunks int
	if err := st.DB().QueryRow(`SELECT count(*) FROM file_chunks WHERE file_id = ?`, big.ID).Scan(&chunks); err != nil || chunks != 0 {
		t.Errorf("deleted file keeps %d chunks (%v)", chunks, err)
	}
}

func TestBatchLifecycle(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 100, backends: 2})
	base := f.srv.URL
	// Lines 3 and 7 ask for more than the model's context: the backend
	// refuses them with a 400, and they land in the error file with it.
	content := batchLines(40, func(i int) string {
		if i == 3 || i == 7 {
			return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"too long"}],"max_tokens":100000000}`, llama)
		}
		return ""
	})
	b := createBatch(t, base, "", uploadBatchFile(t, base, "", content))
	v := waitBatch(t, base, "", b.ID, store.BatchCompleted)
	if v.RequestCounts != (batchCounts{Total: 40, Completed: 38, Failed: 2}) || v.Model == nil || *v.Model != llama ||
		v.InProgressAt == nil || v.FinalizingAt == nil || v.CompletedAt == nil || v.OutputFileID == nil || v.ErrorFileID == nil ||
		v.Usage.InputTokens == 0 || v.Usage.OutputTokens == 0 || v.Usage.TotalTokens != v.Usage.InputTokens+v.Usage.OutputTokens ||
		string(v.Metadata) != `{"run":"test"}` {
		t.Fatalf("completed batch: %+v", v)
	}
	out, errs := outputFile(t, base, "", v.OutputFileID), outputFile(t, base, "", v.ErrorFileID)
	if len(out) != 38 || len(errs) != 2 {
		t.Fatalf("%d output lines, %d error lines", len(out), len(errs))
	}
	for id, o := range out {
		var cc struct {
			Object string `json:"object"`
		}
		if o.Response == nil || o.Response.StatusCode != 200 || json.Unmarshal(o.Response.Body, &cc) != nil || cc.Object != "chat.completion" ||
			o.Error != nil || !strings.HasPrefix(o.ID, "batch_req_") {
			t.Errorf("output line %s: %+v", id, o)
		}
	}
	for _, id := range []string{"req-3", "req-7"} {
		o := errs[id]
		if o.Response == nil || o.Response.StatusCode != http.StatusBadRequest || !strings.Contains(string(o.Response.Body), "maximum context length") {
			t.Errorf("error line %s: %+v", id, o)
		}
	}
	// The file objects say what they are; the batch's event is in the outbox.
	status, fb := bsend(t, http.MethodGet, base+"/v1/files/"+*v.OutputFileID, "", "")
	if fv := decode[fileView](t, fb); status != http.StatusOK || fv.Purpose != "batch_output" {
		t.Errorf("output file: %d %s", status, fb)
	}
	var events int
	if err := f.store.DB().QueryRow(`SELECT count(*) FROM outbox WHERE job_id = ? AND type = 'batch.completed'`, b.ID).Scan(&events); err != nil || events != 1 {
		t.Errorf("batch.completed events: %d (%v)", events, err)
	}

	// Listing pages through batches, newest first.
	b2 := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(2, nil)))
	waitBatch(t, base, "", b2.ID, store.BatchCompleted)
	status, lb := bsend(t, http.MethodGet, base+"/v1/batches?limit=1", "", "")
	page := decode[cursorPage[batchView]](t, lb)
	if status != http.StatusOK || len(page.Data) != 1 || page.Data[0].ID != b2.ID || !page.HasMore || *page.FirstID != b2.ID {
		t.Fatalf("first page: %d %s", status, lb)
	}
	_, lb = bsend(t, http.MethodGet, base+"/v1/batches?limit=1&after="+*page.LastID, "", "")
	if page = decode[cursorPage[batchView]](t, lb); len(page.Data) != 1 || page.Data[0].ID != b.ID || page.HasMore {
		t.Fatalf("second page: %s", lb)
	}
	// A finished batch cannot be cancelled.
	if status, cb := bsend(t, http.MethodPost, base+"/v1/batches/"+b.ID+"/cancel", "", ""); status != http.StatusConflict {
		t.Errorf("cancel a completed batch: %d %s", status, cb)
	}
}

func TestBatchValidation(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 100})
	base := f.srv.URL
	var in bytes.Buffer
	in.Write(batchLines(2, nil))
	in.WriteString(`{"custom_id":"req-0","method":"POST","url":"/v1/chat/completions","body":{"model":"` + llama + `","messages":[]}}` + "\n")
	in.WriteString(`{"custom_id":"x","method":"POST","url":"/v1/embeddings","body":{"model":"` + llama + `","input":"a"}}` + "\n")
	in.WriteString("not json\n\n")
	in.WriteString(`{"custom_id":"y","method":"GET","url":"/v1/chat/completions","body":{}}` + "\n")
	in.WriteString(`{"custom_id":"z","method":"POST","url":"/v1/chat/completions","body":{"model":"no-such-model","messages":[{"role":"user","content":"a"}]}}` + "\n")
	// A NUL no store's text holds (PostgreSQL refuses it).
	in.WriteString(`{"custom_id":"n\u0000ul","method":"POST","url":"/v1/chat/completions","body":{"model":"` + llama + `","messages":[{"role":"user","content":"a"}]}}` + "\n")
	b := createBatch(t, base, "", uploadBatchFile(t, base, "", in.Bytes()))
	v := waitBatch(t, base, "", b.ID, store.BatchFailed)
	var errs []batchError
	if v.Errors == nil || json.Unmarshal(v.Errors.Data, &errs) != nil || v.FailedAt == nil {
		t.Fatalf("failed batch: %+v", v)
	}
	want := map[int]string{3: "duplicate_custom_id", 4: "invalid_url", 5: "invalid_json_line", 7: "invalid_method", 8: "model_not_found", 9: "invalid_value"}
	if len(errs) != len(want) {
		t.Errorf("errors: %+v", errs)
	}
	for _, e := range errs {
		if e.Line == nil || want[*e.Line] != e.Code {
			t.Errorf("error %+v; want codes by line %v", e, want)
		}
	}
	var jobs int
	if err := f.store.DB().QueryRow(`SELECT count(*) FROM jobs`).Scan(&jobs); err != nil || jobs != 0 {
		t.Errorf("a failed batch left %d jobs (%v)", jobs, err)
	}
	// Requests that are refused at once.
	file := uploadBatchFile(t, base, "", batchLines(1, nil))
	for _, body := range []string{
		`{"input_file_id":"file-nope","endpoint":"/v1/chat/completions","completion_window":"24h"}`,
		`{"input_file_id":"` + file + `","endpoint":"/v1/moderations","completion_window":"24h"}`,
		`{"input_file_id":"` + file + `","endpoint":"/v1/chat/completions","completion_window":"1h"}`,
		`{"input_file_id":"` + file + `","endpoint":"/v1/chat/completions","completion_window":"24h","output_expires_after":{"anchor":"created_at","seconds":5}}`,
	} {
		status, b := bsend(t, http.MethodPost, base+"/v1/batches", "", body)
		var eb errorBody
		if status < 400 || json.Unmarshal(b, &eb) != nil || eb.Error.Message == "" {
			t.Errorf("%s: %d %s", body, status, b)
		}
	}
}

// TestBatchCancelAndExpire: a cancelled batch ends with what ran in its
// output file and the rest as batch_cancelled; an expired one with the
// rest as batch_expired. Every line appears once, in one file or the other.
func TestBatchCancelAndExpire(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 2})
	base := f.srv.URL
	for _, end := range []string{store.BatchCancelled, store.BatchExpired} {
		const n = 300
		b := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(n, func(i int) string {
			return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"line %d"}],"max_tokens":40}`, llama, i)
		})))
		eventually.Within(t, 30*time.Second, "some lines done", func() bool {
			_, body := bsend(t, http.MethodGet, base+"/v1/batches/"+b.ID, "", "")
			v := decode[batchView](t, body)
			return v.Status == store.BatchInProgress && v.RequestCounts.Completed > 0
		})
		if end == store.BatchCancelled {
			status, cb := bsend(t, http.MethodPost, base+"/v1/batches/"+b.ID+"/cancel", "", "")
			if v := decode[batchView](t, cb); status != http.StatusOK || (v.Status != store.BatchCancelling && v.Status != store.BatchCancelled) || v.CancellingAt == nil {
				t.Fatalf("cancel: %d %s", status, cb)
			}
		} else {
			// The completion window ends now.
			if _, err := f.store.DB().Exec(`UPDATE batches SET expires_at = ? WHERE id = ?`, time.Now().UnixMicro(), b.ID); err != nil {
				t.Fatal(err)
			}
		}
		v := waitBatch(t, base, "", b.ID, end)
		out, errs := outputFile(t, base, "", v.OutputFileID), outputFile(t, base, "", v.ErrorFileID)
		if len(out)+len(errs) != n || len(out) == 0 || len(errs) == 0 {
			t.Fatalf("%s: %d output lines and %d error lines of %d", end, len(out), len(errs), n)
		}
		code := map[string]string{store.BatchCancelled: "batch_cancelled", store.BatchExpired: "batch_expired"}[end]
		for id, o := range errs {
			if _, both := out[id]; both || o.Error == nil || o.Error.Code != code {
				t.Errorf("%s: error line %s: %+v", end, id, o)
			}
		}
		if v.RequestCounts.Total != n || v.RequestCounts.Completed != len(out) || v.RequestCounts.Failed != len(errs) {
			t.Errorf("%s: counts %+v, files %d and %d", end, v.RequestCounts, len(out), len(errs))
		}
	}
}

// TestBatchFinalizeTakeover: a finalizer that dies midway (its lease
// lapses with its output half written) is taken over; the batch's files
// hold each line once, and the dead one's file is gone.
func TestBatchFinalizeTakeover(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 100})
	base := f.srv.URL
	st := f.store
	// Take the batch's lease while its lines run, as a finalizer would
	// once they end.
	b := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(50, nil)))
	ctx := context.Background()
	var fence int64
	eventually.Within(t, 30*time.Second, "the lease taken", func() bool {
		bt, err := st.Batch(ctx, "default", b.ID)
		if err != nil || bt.Status != store.BatchInProgress {
			return false
		}
		fence, err = st.LeaseBatch(ctx, b.ID, bt.Fence, time.Now(), time.Hour)
		return err == nil
	})
	eventually.Within(t, 30*time.Second, "lines done", func() bool {
		open, err := st.BatchOpen(ctx, b.ID)
		return err == nil && !open
	})
	now := time.Now()
	dead := store.File{ID: newObjectID("file-"), Filename: "dead.jsonl", Purpose: "batch_output", CreatedAt: now}
	deadErr := store.File{ID: newObjectID("file-"), Filename: "dead_err.jsonl", Purpose: "batch_output", CreatedAt: now}
	if err := st.BeginFinalize(ctx, "default", b.ID, fence, store.BatchCompleted, dead, deadErr, now); err != nil {
		t.Fatal(err)
	}
	if err := st.PutFileChunk(ctx, dead.ID, 0, []byte(`{"custom_id":"req-0"}`+"\n")); err != nil {
		t.Fatal(err)
	}
	// ... and dies: its lease lapses, and another finalization takes over.
	if _, err := st.DB().Exec(`UPDATE batches SET lease_until = 1 WHERE id = ?`, b.ID); err != nil {
		t.Fatal(err)
	}
	v := waitBatch(t, base, "", b.ID, store.BatchCompleted)
	if out := outputFile(t, base, "", v.OutputFileID); len(out) != 50 || *v.OutputFileID == dead.ID {
		t.Fatalf("%d output lines in %s", len(out), *v.OutputFileID)
	}
	var left int
	if err := st.DB().QueryRow(`SELECT count(*) FROM files WHERE id IN (?, ?)`, dead.ID, deadErr.ID).Scan(&left); err != nil || left != 0 {
		t.Errorf("the dead finalizer's files: %d left (%v)", left, err)
	}
	// The dead finalizer's late end is refused: the batch stays as the
	// live one ended it.
	if err := st.EndBatch(ctx, store.BatchEnd{ID: b.ID, Fence: fence, Status: store.BatchCompleted, Now: time.Now()}); err == nil {
		t.Error("a finalizer that lost its lease ended the batch")
	}
}

// multipartUpload is an upload's body and its content type.
func multipartUpload(name, purpose string, content []byte) (io.Reader, string) {
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", name)
	fw.Write(content)
	mw.WriteField("purpose", purpose)
	mw.Close()
	return &body, mw.FormDataContentType()
}

// matrixFile uploads a batch file as acme's user.
func matrixFile(t *testing.T, e *matrixEnv, name string) string {
	t.Helper()
	status, b := upload(t, e.f.srv.URL, e.keys[roleUser], name, "batch", batchLines(1, nil))
	if status != http.StatusOK {
		t.Fatalf("upload: %d %s", status, b)
	}
	return decode[fileView](t, b).ID
}

// matrixBatch makes acme's input file and a batch of it that completed.
func matrixBatch(t *testing.T, e *matrixEnv) (file, batch string) {
	t.Helper()
	file = matrixFile(t, e, "matrix.jsonl")
	b := createBatch(t, e.f.srv.URL, e.keys[roleUser], file)
	waitBatch(t, e.f.srv.URL, e.keys[roleUser], b.ID, store.BatchCompleted)
	return file, b.ID
}

// TestBatchAcceptance50k times a 50,000-line batch on PostgreSQL from POST
// /v1/batches to in_progress: its validation and its bulk acceptance (the
// goal is under 10 s). An experiment (KVGATE_EXPERIMENTS=1).
func TestBatchAcceptance50k(t *testing.T) {
	experiment(t)
	f := startFleet(t, fleetOpts{pg: true, jobs: true, runner: true, speedup: 100})
	base := f.srv.URL
	file := uploadBatchFile(t, base, "", batchLines(maxBatchFileLines, nil))
	start := time.Now()
	b := createBatch(t, base, "", file)
	var v batchView
	eventually.Within(t, 2*time.Minute, "validated", func() bool {
		_, body := bsend(t, http.MethodGet, base+"/v1/batches/"+b.ID, "", "")
		v = decode[batchView](t, body)
		return v.Status != store.BatchValidating
	})
	took := time.Since(start)
	if v.Status != store.BatchInProgress {
		t.Fatalf("batch %s", v.Status)
	}
	t.Logf("%d lines validated and accepted in %s (POST /v1/batches to in_progress)", maxBatchFileLines, took.Round(time.Millisecond))
	bsend(t, http.MethodPost, base+"/v1/batches/"+b.ID+"/cancel", "", "")
}

// TestBatchResponses: a batch of /v1/responses lines runs through the jobs'
// executor like the others, once /v1/responses is a job endpoint.
func TestBatchResponses(t *testing.T) {
	if _, ok := jobEndpoints["/v1/responses"]; !ok {
		t.Skip("/v1/responses is not a job endpoint in this tree (the Responses API lands with it)")
	}
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 100})
	base := f.srv.URL
	var in bytes.Buffer
	for i := range 5 {
		fmt.Fprintf(&in, `{"custom_id":"r-%d","method":"POST","url":"/v1/responses","body":{"model":%q,"input":"line %d","max_output_tokens":3}}`+"\n", i, llama, i)
	}
	file := uploadBatchFile(t, base, "", in.Bytes())
	status, body := bsend(t, http.MethodPost, base+"/v1/batches", "", `{"input_file_id":"`+file+`","endpoint":"/v1/responses","completion_window":"24h"}`)
	if status != http.StatusOK {
		t.Fatalf("create: %d %s", status, body)
	}
	v := waitBatch(t, base, "", decode[batchView](t, body).ID, store.BatchCompleted)
	out := outputFile(t, base, "", v.OutputFileID)
	if len(out) != 5 || v.Usage.InputTokens == 0 || v.Usage.OutputTokens == 0 {
		t.Fatalf("%d output lines, usage %+v", len(out), v.Usage)
	}
	for id, o := range out {
		var r struct {
			Object string `json:"object"`
		}
		if o.Response == nil || o.Response.StatusCode != 200 || json.Unmarshal(o.Response.Body, &r) != nil || r.Object != "response" {
			t.Errorf("line %s: %+v", id, o)
		}
	}
}

// TestBatchFairWithinTenant: a tenant's small batch, submitted while its
// huge one runs, is not held behind the huge one's backlog: it takes its
// turns beside it and ends while the huge one still runs.
func TestBatchFairWithinTenant(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 5})
	base := f.srv.URL
	slow := func(i int) string {
		return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"line %d"}],"max_tokens":30}`, llama, i)
	}
	huge := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(600, slow)))
	eventually.Within(t, 30*time.Second, "the huge batch runs", func() bool {
		_, body := bsend(t, http.MethodGet, base+"/v1/batches/"+huge.ID, "", "")
		v := decode[batchView](t, body)
		return v.Status == store.BatchInProgress && v.RequestCounts.Completed > 0
	})
	small := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(10, slow)))
	waitBatch(t, base, "", small.ID, store.BatchCompleted)
	_, body := bsend(t, http.MethodGet, base+"/v1/batches/"+huge.ID, "", "")
	v := decode[batchView](t, body)
	if v.Status != store.BatchInProgress || v.RequestCounts.Completed > 300 {
		t.Errorf("the small batch ended only once the huge one had done %d of its %d lines (%s)", v.RequestCounts.Completed, v.RequestCounts.Total, v.Status)
	}
	bsend(t, http.MethodPost, base+"/v1/batches/"+huge.ID+"/cancel", "", "")
	waitBatch(t, base, "", huge.ID, store.BatchCancelled)
}

// TestBatchPendingLimits: a batch is held to its tenant's pending-job
// limits as a whole, as its lines' submissions as jobs would be.
func TestBatchPendingLimits(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, runner: true, speedup: 100, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	key := newTenant(t, st, "acme", store.Limits{MaxPendingJobs: 5}, store.RoleUser)
	base := f.srv.URL
	big := createBatch(t, base, key, uploadBatchFile(t, base, key, batchLines(10, nil)))
	v := waitBatch(t, base, key, big.ID, store.BatchFailed)
	var errs []batchError
	if v.Errors == nil || json.Unmarshal(v.Errors.Data, &errs) != nil || len(errs) != 1 || errs[0].Code != "token_limit_exceeded" {
		t.Fatalf("a batch over the pending-job limit: %+v", v)
	}
	small := createBatch(t, base, key, uploadBatchFile(t, base, key, batchLines(5, nil)))
	waitBatch(t, base, key, small.ID, store.BatchCompleted)
}

// TestBatchTwoReplicas: two replicas on one PostgreSQL store, each with
// its batch worker. A file uploaded through one is a batch's input through
// the other; the batch is validated, run and finalized once, by whichever
// replica takes its lease; both show it, and its files, the same.
func TestBatchTwoReplicas(t *testing.T) {
	var urls []string
	for i := range 2 {
		_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: llamaProfile(t), Speedup: 100, Seed: uint64(i)})
		urls = append(urls, srv.URL)
	}
	st := pgtest.Open(t)
	reps := startReplicas(t, 2, urls, st, false)
	a, b := reps[0].srv.URL, reps[1].srv.URL
	file := uploadBatchFile(t, a, "", batchLines(200, nil))
	created := createBatch(t, b, "", file)
	v := waitBatch(t, a, "", created.ID, store.BatchCompleted)
	if w := waitBatch(t, b, "", created.ID, store.BatchCompleted); w.OutputFileID == nil || *w.OutputFileID != *v.OutputFileID {
		t.Fatalf("the replicas disagree: %+v, %+v", v, w)
	}
	if out := outputFile(t, b, "", v.OutputFileID); len(out) != 200 {
		t.Fatalf("%d output lines, want 200", len(out))
	}
	var events, files int
	if err := st.DB().QueryRow(`SELECT count(*) FROM outbox WHERE job_id = $1`, created.ID).Scan(&events); err != nil || events != 1 {
		t.Errorf("%d batch events (%v), want one batch.completed", events, err)
	}
	if err := st.DB().QueryRow(`SELECT count(*) FROM files WHERE purpose = 'batch_output'`).Scan(&files); err != nil || files != 1 {
		t.Errorf("%d output files kept (%v), want 1", files, err)
	}
}

// TestBatchValidationTakeoverFails: a validation that began accepting a
// batch's lines as jobs loses its claim, and the input file is deleted
// before the next validation reads it. That one fails the batch, and the
// lines already accepted go with it, cancelled: none of a failed batch
// runs, and none is left queued outside both of its files.
func TestBatchValidationTakeoverFails(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, speedup: 100})
	base, st, ctx := f.srv.URL, f.store, context.Background()
	fileID := uploadBatchFile(t, base, "", batchLines(20, nil))
	now := time.Now()
	b := store.Batch{ID: newObjectID("batch_"), Tenant: "default", Endpoint: "/v1/chat/completions", InputFileID: fileID,
		CompletionWindow: "24h", Status: store.BatchValidating, CreatedAt: now, ExpiresAt: now.Add(24 * time.Hour)}
	if err := st.CreateBatch(ctx, b); err != nil {
		t.Fatal(err)
	}
	// The first validation: its claim, its priorities, half its lines.
	fence, err := st.LeaseBatch(ctx, b.ID, 0, now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.SetBatchPriorityBase(ctx, b.ID, fence, 1); err != nil {
		t.Fatal(err)
	}
	var jobs []store.NewJob
	var customs []string
	for i := range 10 {
		jobs = append(jobs, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), Tenant: "default",
			IdempotencyKey: fmt.Sprintf("%s%s/%d", batchKeyPrefix, b.ID, i), RequestHash: "h", Endpoint: b.Endpoint, Model: llama,
			Body: json.RawMessage(chatReq(2)), Priority: 1 + i, TokenEstimate: 100, MaxAttempts: 3, Deadline: b.ExpiresAt, Now: now})
		customs = append(customs, fmt.Sprint("req-", i))
	}
	if err := st.AcceptBatchLines(ctx, b.ID, fence, jobs, customs); err != nil {
		t.Fatal(err)
	}
	// ... then dies; the file is deleted before the takeover.
	if status, body := bsend(t, http.MethodDelete, base+"/v1/files/"+fileID, "", ""); status != http.StatusOK {
		t.Fatalf("delete the input file: %d %s", status, body)
	}
	if _, err := st.DB().Exec(`UPDATE batches SET lease_until = 1 WHERE id = ?`, b.ID); err != nil {
		t.Fatal(err)
	}
	// The batch worker of a replica that stays (no runner: the lines
	// accepted stay queued until the batch decides their fate).
	wctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Go(func() { _ = f.api.RunBatches(wctx) })
	v := waitBatch(t, base, "", b.ID, store.BatchFailed)
	if v.Errors == nil || !strings.Contains(string(v.Errors.Data), `"code":"invalid_file"`) {
		t.Errorf("errors %+v, want invalid_file", v.Errors)
	}
	for _, n := range jobs {
		j, err := st.Get(ctx, "default", n.ID)
		if err != nil || j.State != store.Cancelled {
			t.Errorf("line job %s: %s, %v; want CANCELLED", n.IdempotencyKey, j.State, err)
		}
	}
}

// TestBatchWorkerPagesThroughOpenBatches: batches in progress (here, lines
// nobody runs) do not keep the worker from a batch submitted after them,
// however many they are. The worker read one page of open batches, by
// lease: those in progress hold none, so the oldest filled every page and
// a later batch stayed validating.
func TestBatchWorkerPagesThroughOpenBatches(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true}) // no runner: lines stay queued
	f.api.batchWk.page = 2                    // before the worker starts
	runBatchWorker(t, f)
	base := f.srv.URL
	inProgress := func(id string) {
		t.Helper()
		eventually.True(t, "batch "+id+" in progress", func() bool {
			_, body := bsend(t, http.MethodGet, base+"/v1/batches/"+id, "", "")
			return decode[batchView](t, body).Status == store.BatchInProgress
		})
	}
	for range 3 {
		inProgress(createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(2, nil))).ID)
	}
	inProgress(createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(2, nil))).ID)
}

// TestBatchExpiresWhileValidating: a batch still validating when its
// completion window ends does not wait on for ever. One whose lines are
// valid is accepted and ends expired at once, each line a batch_expired
// error; one whose acceptance began and whose lines now fail here (tried
// again after each lease) fails with batch_expired, the lines already in
// cancelled.
func TestBatchExpiresWhileValidating(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true}) // the batch worker starts below
	base := f.srv.URL
	valid := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(3, nil)))
	stuck := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(3, func(i int) string {
		return `{"model":"no-such-model","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`
	})))
	for _, q := range []string{
		`UPDATE batches SET expires_at = ` + strconv.FormatInt(time.Now().UnixMicro(), 10) + ` WHERE id IN ('` + valid.ID + `', '` + stuck.ID + `')`,
		`UPDATE batches SET priority_base = 1 WHERE id = '` + stuck.ID + `'`, // its acceptance began
	} {
		if _, err := f.store.DB().Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	runBatchWorker(t, f)
	if v := waitBatch(t, base, "", valid.ID, store.BatchExpired); v.RequestCounts.Total != 3 || v.RequestCounts.Failed != 3 {
		t.Errorf("the valid batch past its window: %+v, want 3 lines expired", v.RequestCounts)
	}
	v := waitBatch(t, base, "", stuck.ID, store.BatchFailed)
	if v.Errors == nil || !strings.Contains(string(v.Errors.Data), `"code":"batch_expired"`) {
		t.Errorf("the batch stuck validating past its window: %+v, want failed with batch_expired", v)
	}
}

// TestBatchLiveCountsCountCancelledLines: a line cancelled while its batch
// runs counts as failed in the live request_counts, as it will in the
// final ones, so that completed + failed never falls short of the lines
// that ended.
func TestBatchLiveCountsCountCancelledLines(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true}) // no runner: lines stay queued
	runBatchWorker(t, f)
	base := f.srv.URL
	b := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(3, nil)))
	eventually.True(t, "the batch in progress", func() bool {
		_, body := bsend(t, http.MethodGet, base+"/v1/batches/"+b.ID, "", "")
		return decode[batchView](t, body).Status == store.BatchInProgress
	})
	jobs, _, err := f.store.List(context.Background(), "default", store.ListFilter{Limit: 10})
	if err != nil || len(jobs) != 3 {
		t.Fatalf("the batch's lines: %d jobs, %v", len(jobs), err)
	}
	if status, body := bsend(t, http.MethodPost, base+"/v1/jobs/"+jobs[0].ID+"/cancel", "", ""); status != http.StatusOK {
		t.Fatalf("cancel a line: %d %s", status, body)
	}
	_, body := bsend(t, http.MethodGet, base+"/v1/batches/"+b.ID, "", "")
	if v := decode[batchView](t, body); v.RequestCounts.Total != 3 || v.RequestCounts.Failed != 1 || v.RequestCounts.Completed != 0 {
		t.Errorf("live counts with a line cancelled: %+v, want total 3, failed 1", v.RequestCounts)
	}
}

// TestBatchLineLargerThanABody: a line larger than a request body may be
// is refused at validation (request_too_large, its line named), without
// being read whole, as POST /v1/jobs refuses such a body.
func TestBatchLineLargerThanABody(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, gateway: Config{MaxBodyBytes: 4096}})
	base := f.srv.URL
	input := batchLines(3, func(i int) string {
		if i != 1 {
			return ""
		}
		return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"user":%q}`, llama, strings.Repeat("u", 200<<10))
	})
	b := createBatch(t, base, "", uploadBatchFile(t, base, "", input))
	v := waitBatch(t, base, "", b.ID, store.BatchFailed)
	if v.Errors == nil || !strings.Contains(string(v.Errors.Data), `"code":"request_too_large"`) || !strings.Contains(string(v.Errors.Data), `"line":2`) {
		t.Errorf("a batch with a 200 KiB line, bodies at most 4 KiB: %+v, want failed with request_too_large on line 2", v.Errors)
	}
}

// runBatchWorker runs the batch worker of a fleet started without a
// runner until the test ends.
func runBatchWorker(t *testing.T, f *fleet) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = f.api.RunBatches(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// countingReader is an endless upload body of one byte.
type countingReader struct{}

func (countingReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'x'
	}
	return len(p), nil
}

// chunkCounter counts the file chunks the gateway stores.
type chunkCounter struct {
	store.Batches
	n atomic.Int64
}

func (c *chunkCounter) PutFileChunk(ctx context.Context, id string, seq int, data []byte) error {
	c.n.Add(1)
	return c.Batches.PutFileChunk(ctx, id, seq, data)
}

// chunkBarrier holds the first chunk of the first two files it sees until
// both have come: two uploads under way at once.
type chunkBarrier struct {
	store.Batches
	mu    sync.Mutex
	files map[string]bool
	both  chan struct{}
}

func (c *chunkBarrier) PutFileChunk(ctx context.Context, id string, seq int, data []byte) error {
	c.mu.Lock()
	first := !c.files[id] && len(c.files) < 2
	if first {
		c.files[id] = true
		if len(c.files) == 2 {
			close(c.both)
		}
	}
	c.mu.Unlock()
	if first {
		select {
		case <-c.both:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return c.Batches.PutFileChunk(ctx, id, seq, data)
}

// TestTenantFileStorageAtOnce: two uploads under way at once each see the
// whole room when they begin; together they still may not pass the
// tenant's storage: the one that ends past it is refused.
func TestTenantFileStorageAtOnce(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}, TenantFileBytes: 3 << 20},
		server: func(s *Server) {
			s.batches = &chunkBarrier{Batches: s.batches, files: map[string]bool{}, both: make(chan struct{})}
		}})
	acme := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	two := bytes.Repeat([]byte("x"), 2<<20)
	statuses := make(chan int, 2)
	for _, name := range []string{"a.bin", "b.bin"} {
		go func() {
			status, _ := upload(t, f.srv.URL, acme, name, "user_data", two)
			statuses <- status
		}()
	}
	ok := 0
	for range 2 {
		if <-statuses == http.StatusOK {
			ok++
		}
	}
	used, err := st.FileBytes(context.Background(), "acme", time.Now())
	// One, or none where both ended at once with all their chunks in.
	if ok > 1 || err != nil || used > 3<<20 {
		t.Errorf("%d of two 2 MiB uploads at once stored, the tenant's files hold %d bytes (%v); want at most one, within its 3 MiB", ok, used, err)
	}
}

// TestUploadLimits: a file larger than its purpose allows is a 413
// file_too_large, none of it kept; when the purpose comes before the file,
// the upload stops storing at the purpose's limit instead of storing up to
// the largest file of any purpose first, and the client, still sending,
// hears the 413.
func TestUploadLimits(t *testing.T) {
	var chunks *chunkCounter
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, server: func(s *Server) {
		s.fileMax = fileMax{batch: 1 << 20, any: 64 << 20}
		chunks = &chunkCounter{Batches: s.batches}
		s.batches = chunks
	}})
	big := bytes.Repeat([]byte(`{"custom_id":"x"}`+"\n"), (1<<20)/18+1) // past the batch limit
	status, b := upload(t, f.srv.URL, "", "input.jsonl", "batch", big)
	if status != http.StatusRequestEntityTooLarge || !strings.Contains(string(b), `"file_too_large"`) {
		t.Errorf("a batch file past its limit, purpose last: %d %s", status, b)
	}
	if status, b := upload(t, f.srv.URL, "", "notes.txt", "user_data", big); status != http.StatusOK {
		t.Errorf("the same bytes under another purpose: %d %s", status, b)
	}

	// Purpose first, then a file far past the batch limit but within
	// any purpose's: stored no further than the limit.
	chunks.n.Store(0)
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		mw.WriteField("purpose", "batch")
		fw, _ := mw.CreateFormFile("file", "input.jsonl")
		_, err := io.Copy(fw, io.LimitReader(countingReader{}, 48<<20))
		if err == nil {
			err = mw.Close()
		}
		pw.CloseWithError(err)
	}()
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/files", pr)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("a batch file past its limit, purpose first: %v, want the 413 heard", err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("a batch file past its limit, purpose first: %d %s", resp.StatusCode, b)
	}
	if n := chunks.n.Load(); n > 2 {
		t.Errorf("the upload stored %d chunks (1 MiB each) of a batch file whose limit is 1 MiB", n)
	}
	if fs, _, err := f.store.ListFiles(context.Background(), "default", store.FileFilter{}, time.Now()); err != nil || len(fs) != 1 {
		t.Errorf("files kept: %d (%v), want the user_data file alone", len(fs), err)
	}
}

// TestBatchAtTheEndOfItsWindow: the window decides a batch's end only for
// the lines it cuts. A batch whose lines all ended is completed though the
// worker looks after its window (one replica's worker goes through the
// batches one at a time, and a large file's validation delays the rest);
// a cancel that the window overtakes ends the batch expired, its open
// lines cut as batch_expired, not cancelled.
func TestBatchAtTheEndOfItsWindow(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, speedup: 100})
	base, ctx := f.srv.URL, context.Background()
	started := func(n int) store.Batch {
		t.Helper()
		v := createBatch(t, base, "", uploadBatchFile(t, base, "", batchLines(n, nil)))
		b, err := f.store.Batch(ctx, "default", v.ID)
		if err != nil {
			t.Fatal(err)
		}
		if err := f.api.workBatch(ctx, b); err != nil { // validates it
			t.Fatal(err)
		}
		if b, err = f.store.Batch(ctx, "default", v.ID); err != nil || b.Status != store.BatchInProgress {
			t.Fatalf("validated batch: %+v %v", b, err)
		}
		return b
	}
	pastWindow := func(b store.Batch) store.Batch {
		t.Helper()
		if _, err := f.store.DB().Exec(`UPDATE batches SET expires_at = ? WHERE id = ?`, time.Now().Add(-time.Second).UnixMicro(), b.ID); err != nil {
			t.Fatal(err)
		}
		b, err := f.store.Batch(ctx, "default", b.ID)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}

	done := started(3)
	rctx, cancel := context.WithCancel(ctx)
	runner := scheduler.NewRunner(f.store, f.sched, f.api, scheduler.RunnerConfig{Concurrency: 4, Lease: 10 * time.Second, Poll: 10 * time.Millisecond})
	stopped := make(chan struct{})
	go func() { defer close(stopped); _ = runner.Run(rctx) }()
	eventually.True(t, "the lines end", func() bool {
		open, err := f.store.BatchOpen(ctx, done.ID)
		return err == nil && !open
	})
	cancel()
	<-stopped
	if err := f.api.workBatch(ctx, pastWindow(done)); err != nil {
		t.Fatal(err)
	}
	if v := waitBatch(t, base, "", done.ID); v.Status != store.BatchCompleted || v.RequestCounts.Completed != 3 || v.ExpiredAt != nil {
		t.Errorf("a batch whose lines all ended, looked at after its window: %s, counts %+v", v.Status, v.RequestCounts)
	}

	queued := started(3) // no runner: its lines stay queued
	if status, b := bsend(t, http.MethodPost, base+"/v1/batches/"+queued.ID+"/cancel", "", ""); status != http.StatusOK {
		t.Fatalf("cancel: %d %s", status, b)
	}
	if err := f.api.workBatch(ctx, pastWindow(queued)); err != nil {
		t.Fatal(err)
	}
	v := waitBatch(t, base, "", queued.ID)
	if v.Status != store.BatchExpired || v.ExpiredAt == nil || v.RequestCounts.Failed != 3 {
		t.Fatalf("a cancel the window overtook: %s, counts %+v", v.Status, v.RequestCounts)
	}
	for id, o := range outputFile(t, base, "", v.ErrorFileID) {
		if o.Error == nil || o.Error.Code != "batch_expired" {
			t.Errorf("line %s: %+v, want batch_expired", id, o)
		}
	}
}

// TestBatchUsageOfEachAPI: a batch's usage sums its lines' usage as each
// API names it: chat and completions' prompt and completion tokens with
// their details, the Responses API's input and output tokens with theirs.
func TestBatchUsageOfEachAPI(t *testing.T) {
	var u batchUsage
	addUsage(&u, json.RawMessage(`{"usage":{"prompt_tokens":10,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":8},"completion_tokens_details":{"reasoning_tokens":2}}}`))
	addUsage(&u, json.RawMessage(`{"usage":{"input_tokens":20,"output_tokens":6,"input_tokens_details":{"cached_tokens":16},"output_tokens_details":{"reasoning_tokens":3}}}`))
	addUsage(&u, json.RawMessage(`{"usage":{"prompt_tokens":5,"total_tokens":5}}`)) // embeddings
	if u.InputTokens != 35 || u.OutputTokens != 10 || u.TotalTokens != 45 ||
		u.InputTokensDetails.CachedTokens != 24 || u.OutputTokensDetails.ReasoningTokens != 5 {
		t.Errorf("batch usage %+v, want 35 in (24 cached), 10 out (5 reasoning), 45 in all", u)
	}
}

// TestTenantFileStorage: a tenant's files together hold at most
// Config.TenantFileBytes: an upload that would pass it is refused, as it
// passes it (no more of it stored), with what the tenant holds; another
// tenant's files do not count; a deleted file frees its room.
func TestTenantFileStorage(t *testing.T) {
	st := sqliteStore(t)
	var chunks *chunkCounter
	f := startFleet(t, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}, TenantFileBytes: 3 << 20},
		server: func(s *Server) {
			chunks = &chunkCounter{Batches: s.batches}
			s.batches = chunks
		}})
	acme := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	globex := newTenant(t, st, "globex", store.Limits{}, store.RoleUser)
	mib := bytes.Repeat([]byte("x"), 1<<20)
	status, b := upload(t, f.srv.URL, acme, "two.bin", "user_data", append(append([]byte{}, mib...), mib...))
	if status != http.StatusOK {
		t.Fatalf("2 MiB of 3: %d %s", status, b)
	}
	first := decode[fileView](t, b)
	chunks.n.Store(0)
	status, b = upload(t, f.srv.URL, acme, "four.bin", "user_data", bytes.Repeat(mib, 4))
	if status != http.StatusBadRequest || !strings.Contains(string(b), `"storage_limit_exceeded"`) || !strings.Contains(string(b), "2097152 of the 3145728") {
		t.Errorf("4 MiB more: %d %s", status, b)
	}
	if n := chunks.n.Load(); n > 2 {
		t.Errorf("%d chunks of the refused upload stored, want it cut as it passed the room (1 MiB)", n)
	}
	if status, b := upload(t, f.srv.URL, globex, "two.bin", "user_data", append(append([]byte{}, mib...), mib...)); status != http.StatusOK {
		t.Errorf("another tenant's 2 MiB: %d %s", status, b)
	}
	if status, _ := bsend(t, http.MethodDelete, f.srv.URL+"/v1/files/"+first.ID, acme, ""); status != http.StatusOK {
		t.Fatalf("delete: %d", status)
	}
	if status, b := upload(t, f.srv.URL, acme, "three.bin", "user_data", bytes.Repeat(mib, 3)); status != http.StatusOK {
		t.Errorf("3 MiB once the 2 were deleted: %d %s", status, b)
	}
}

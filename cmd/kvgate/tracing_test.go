package main

import (
	"bytes"
	"compress/gzip"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
)

// otlpReceiver is an OTLP/HTTP trace endpoint in the test: it decodes
// what kvgate's exporter sends with the OTLP protobufs and keeps the spans.
type otlpReceiver struct {
	mu    sync.Mutex
	spans []*tracepb.Span
	posts int
}

func (o *otlpReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "want POST /v1/traces application/x-protobuf", http.StatusBadRequest)
		return
	}
	var rd io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		rd = zr
	}
	b, err := io.ReadAll(rd)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	o.mu.Lock()
	o.posts++
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			o.spans = append(o.spans, ss.GetSpans()...)
		}
	}
	o.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

func (o *otlpReceiver) trace(traceID string) []*tracepb.Span {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range o.spans {
		if hex.EncodeToString(s.GetTraceId()) == traceID {
			out = append(out, s)
		}
	}
	return out
}

func attr(s *tracepb.Span, key string) string {
	for _, kv := range s.GetAttributes() {
		if kv.GetKey() == key {
			v := kv.GetValue()
			switch {
			case v.GetStringValue() != "":
				return v.GetStringValue()
			default:
				return fmt.Sprint(v.GetIntValue())
			}
		}
	}
	return ""
}

func named(spans []*tracepb.Span, name string) []*tracepb.Span {
	var out []*tracepb.Span
	for _, s := range spans {
		if s.GetName() == name {
			out = append(out, s)
		}
	}
	return out
}

// traceTree renders spans as a tree by parent, children in start order,
// each with its duration and its kvgate attributes.
func traceTree(spans []*tracepb.Span) string {
	byParent := map[string][]*tracepb.Span{}
	ids := map[string]bool{}
	for _, s := range spans {
		ids[hex.EncodeToString(s.GetSpanId())] = true
	}
	for _, s := range spans {
		p := hex.EncodeToString(s.GetParentSpanId())
		if !ids[p] {
			p = ""
		}
		byParent[p] = append(byParent[p], s)
	}
	var sb strings.Builder
	var walk func(parent, indent string)
	walk = func(parent, indent string) {
		kids := byParent[parent]
		sort.Slice(kids, func(i, j int) bool { return kids[i].GetStartTimeUnixNano() < kids[j].GetStartTimeUnixNano() })
		for i, s := range kids {
			branch, next := "├── ", "│   "
			if i == len(kids)-1 {
				branch, next = "└── ", "    "
			}
			if parent == "" {
				branch, next = "", ""
			}
			d := time.Duration(s.GetEndTimeUnixNano() - s.GetStartTimeUnixNano())
			var as []string
			for _, k := range []string{"kvgate.attempt", "kvgate.fence", "kvgate.backend", "kvgate.final_state", "http.response.status_code"} {
				if v := attr(s, k); v != "" {
					as = append(as, strings.TrimPrefix(k, "kvgate.")+"="+v)
				}
			}
			for _, e := range s.GetEvents() {
				as = append(as, "event:"+e.GetName())
			}
			if s.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR {
				as = append(as, "error")
			}
			fmt.Fprintf(&sb, "%s%s%s  %s  %s\n", indent, branch, s.GetName(), d.Round(10*time.Microsecond), strings.Join(as, " "))
			walk(hex.EncodeToString(s.GetSpanId()), indent+next)
		}
	}
	walk("", "")
	return sb.String()
}

// headerProxy passes requests to a real simulator and keeps the
// traceparent headers kvgate sent it.
type headerProxy struct {
	mu      sync.Mutex
	parents []string
	next    http.Handler
	// failCompletions answers this many POST /v1/completions with a 500
	// of its own, before passing them on: a job's first attempt fails.
	failCompletions int
}

func (h *headerProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	if tp := r.Header.Get("Traceparent"); tp != "" {
		h.parents = append(h.parents, tp)
	}
	fail := r.URL.Path == "/v1/completions" && h.failCompletions > 0
	if fail {
		h.failCompletions--
	}
	h.mu.Unlock()
	if fail {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte(`{"error":{"message":"injected failure","type":"server_error"}}`))
		return
	}
	h.next.ServeHTTP(w, r)
}

func (h *headerProxy) seen() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.parents)
}

// TestTracesOverOTLP: with an OTLP endpoint configured, kvgate exports
// over OTLP/HTTP (decoded here with the OTLP protobufs): an interactive
// request's span is the child of the caller's traceparent, with the
// admission wait and the backend call below it (the first token marked
// on a stream), and the backend receives a traceparent naming that call;
// a job's trace, whose id is the job's, holds its acceptance, the
// publication and receipt of each of its events, one span per attempt
// (job id, attempt, fence) with its admission and backend call, and the
// root span from acceptance to the final state; the submitting request's
// span, in the caller's trace, links to it.
func TestTracesOverOTLP(t *testing.T) {
	recv := &otlpReceiver{}
	collector := httptest.NewServer(recv)
	t.Cleanup(collector.Close)
	p, _ := vllmsim.LookupProfile("h100-llama-3.1-8b")
	_, sim := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Speedup: 50})
	target, _ := url.Parse(sim.URL)
	proxy := &headerProxy{next: httputil.NewSingleHostReverseProxy(target), failCompletions: 1}
	backend := httptest.NewServer(proxy)
	t.Cleanup(backend.Close)

	base, stderr := startServe(t, "--data-dir", t.TempDir(), "--backend", backend.URL, "--otlp-endpoint", collector.URL)

	eventually.True(t, "kvgate ready", func() bool {
		r, err := http.Get(base + "/readyz")
		if err != nil {
			return false
		}
		r.Body.Close()
		return r.StatusCode == http.StatusOK
	})
	// Interactive, streamed, under the caller's trace.
	const callerTrace, callerSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	status, body := call(t, base, http.MethodPost, "/v1/chat/completions", "",
		`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}`,
		"Traceparent", "00-"+callerTrace+"-"+callerSpan+"-01", "X-Request-Id", "traced-1")
	if status != http.StatusOK {
		t.Fatalf("chat: %d %s", status, body)
	}
	var chat []*tracepb.Span
	eventually.True(t, "the chat request's spans", func() bool {
		chat = recv.trace(callerTrace)
		return len(named(chat, "/v1/chat/completions")) == 1 && len(named(chat, "backend /v1/chat/completions")) == 1
	})
	server := named(chat, "/v1/chat/completions")[0]
	if hex.EncodeToString(server.GetParentSpanId()) != callerSpan || server.GetKind() != tracepb.Span_SPAN_KIND_SERVER ||
		attr(server, "kvgate.request_id") != "traced-1" || attr(server, "http.response.status_code") != "200" || attr(server, "kvgate.backend") == "" {
		t.Errorf("request span: parent %x, kind %v, attributes %v", server.GetParentSpanId(), server.GetKind(), server.GetAttributes())
	}
	adm, bcall := named(chat, "admission"), named(chat, "backend /v1/chat/completions")[0]
	if len(adm) != 1 || !bytes.Equal(adm[0].GetParentSpanId(), server.GetSpanId()) || !bytes.Equal(bcall.GetParentSpanId(), server.GetSpanId()) ||
		bcall.GetKind() != tracepb.Span_SPAN_KIND_CLIENT {
		t.Errorf("admission %v and backend %v should be children of the request span", adm, bcall)
	}
	if len(bcall.GetEvents()) == 0 || bcall.GetEvents()[0].GetName() != "first_token" || attr(bcall, "kvgate.ttft_seconds") == "" {
		t.Errorf("backend span lacks the first token: %v", bcall.GetEvents())
	}
	want := "00-" + callerTrace + "-" + hex.EncodeToString(bcall.GetSpanId()) + "-01"
	if !slices.Contains(proxy.seen(), want) {
		t.Errorf("the backend got traceparents %v, want %s", proxy.seen(), want)
	}

	// A job, submitted under the caller's trace.
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/jobs", strings.NewReader(
		`{"endpoint":"/v1/completions","body":{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"hi","max_tokens":3}}`))
	req.Header.Set("Idempotency-Key", "traced-job")
	req.Header.Set("Traceparent", "00-"+callerTrace+"-"+callerSpan+"-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	jobID := strings.TrimPrefix(resp.Header.Get("Location"), "/v1/jobs/")
	jobTrace := strings.ReplaceAll(jobID, "-", "")
	eventually.True(t, "the job to succeed", func() bool {
		st, b := call(t, base, http.MethodGet, "/v1/jobs/"+jobID, "", "")
		return st == http.StatusOK && strings.Contains(string(b), `"SUCCEEDED"`)
	})
	// Its delivery: the caller fetches the result.
	if st, b := call(t, base, http.MethodGet, "/v1/jobs/"+jobID+"/result", "", ""); st != http.StatusOK {
		t.Fatalf("result: %d %s", st, b)
	}
	var job []*tracepb.Span
	eventually.True(t, "the job's trace through to its root span and its delivery", func() bool {
		job = recv.trace(jobTrace)
		return len(named(job, "job")) == 1 && len(named(job, "inbox.receive job.succeeded")) == 1 && len(named(job, "delivery result")) == 1
	})
	tree := traceTree(job)
	t.Logf("the trace of job %s:\n%s", jobID, tree)
	if out := os.Getenv("KVGATE_TRACE_TREE"); out != "" {
		_ = os.WriteFile(out, []byte(tree), 0o644)
	}
	root := named(job, "job")[0]
	if len(root.GetParentSpanId()) != 0 || attr(root, "kvgate.job_id") != jobID || attr(root, "kvgate.final_state") != "SUCCEEDED" {
		t.Errorf("root span: parent %x, attributes %v", root.GetParentSpanId(), root.GetAttributes())
	}
	for _, name := range []string{"accept", "outbox.publish job.accepted", "inbox.receive job.accepted",
		"outbox.publish job.succeeded", "inbox.receive job.succeeded", "delivery result"} {
		ss := named(job, name)
		if len(ss) != 1 || !bytes.Equal(ss[0].GetParentSpanId(), root.GetSpanId()) {
			t.Errorf("%s: %d spans, want one under the root\n%s", name, len(ss), tree)
		}
	}
	// One span per attempt: the first failed on the backend's 500, the
	// second succeeded, each with its own fence, admission and backend
	// call (whose traceparent the backend received).
	attempts := named(job, "attempt")
	sort.Slice(attempts, func(i, j int) bool { return attempts[i].GetStartTimeUnixNano() < attempts[j].GetStartTimeUnixNano() })
	if len(attempts) != 2 {
		t.Fatalf("%d attempt spans, want 2\n%s", len(attempts), tree)
	}
	for i, a := range attempts {
		n := fmt.Sprint(i + 1)
		if attr(a, "kvgate.job_id") != jobID || attr(a, "kvgate.attempt") != n || attr(a, "kvgate.fence") != n || attr(a, "kvgate.backend") == "" {
			t.Errorf("attempt %d attributes %v", i+1, a.GetAttributes())
		}
		if failed := a.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR; failed != (i == 0) {
			t.Errorf("attempt %d: status %v", i+1, a.GetStatus())
		}
		var kids []*tracepb.Span
		for _, s := range job {
			if bytes.Equal(s.GetParentSpanId(), a.GetSpanId()) {
				kids = append(kids, s)
			}
		}
		if len(kids) != 2 || len(named(kids, "admission")) != 1 || len(named(kids, "backend /v1/completions")) != 1 {
			t.Errorf("attempt %d's children: %d, want its admission and backend call\n%s", i+1, len(kids), tree)
			continue
		}
		b := named(kids, "backend /v1/completions")[0]
		want := "00-" + jobTrace + "-" + hex.EncodeToString(b.GetSpanId()) + "-01"
		if !slices.Contains(proxy.seen(), want) {
			t.Errorf("the backend got traceparents %v, want attempt %d's %s", proxy.seen(), i+1, want)
		}
	}
	// The submitting request's span, in the caller's trace, links to the
	// job's root.
	var linked bool
	for _, s := range named(recv.trace(callerTrace), "/v1/jobs") {
		for _, l := range s.GetLinks() {
			linked = linked || hex.EncodeToString(l.GetTraceId()) == jobTrace && bytes.Equal(l.GetSpanId(), root.GetSpanId())
		}
	}
	if !linked {
		t.Errorf("the submission's span does not link to the job's trace")
	}
	if strings.Contains(stderr.String(), "level=ERROR") {
		t.Errorf("errors in the log:\n%s", stderr.String())
	}
}

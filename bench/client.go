package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Error classes of a failed request. 429 and 503 are load shedding (kvgate's
// admission, or a backend's relayed by it); other statuses are failures.
const (
	ErrRateLimited = "rate_limited" // HTTP 429
	ErrOverloaded  = "overloaded"   // HTTP 503 (kvgate: server_overloaded)
	ErrServer      = "server_error" // other 5xx: the backend or gateway failed
	ErrClient      = "client_error" // other 4xx: a bad request (context too long, unknown model)
	ErrTransport   = "transport"    // connection refused or reset before an answer
	ErrTimeout     = "timeout"      // RequestTimeout passed
	ErrStream      = "stream"       // an error event, a cut or a malformed stream after 200
	ErrJob         = "job_failed"   // a deferred job ended FAILED_TERMINAL or CANCELLED
	ErrCancelled   = "cancelled"    // the run itself was stopped (Ctrl-C) with the request in flight
)

// classify maps an HTTP status to its error class.
func classify(status int) string {
	switch {
	case status == http.StatusTooManyRequests:
		return ErrRateLimited
	case status == http.StatusServiceUnavailable:
		return ErrOverloaded
	case status >= 500:
		return ErrServer
	default:
		return ErrClient
	}
}

// DefaultMaxConnections caps a run's connections per host when
// Config.MaxConnections is 0.
const DefaultMaxConnections = 4096

// NewHTTPClient returns a client tuned for load generation: keep-alive
// connections, at most maxConns per host (0: no cap), no compression, no
// overall timeout (each request carries its own). Requests beyond the cap
// wait for a connection, and that wait counts in their latency.
func NewHTTPClient(maxConns int) *http.Client {
	c, _ := newTrackedClient(maxConns)
	return c
}

// newTrackedClient is NewHTTPClient with a handle that closes every
// connection the client opened, including those dialled for a request
// that another connection served first and those still being dialled: a
// server waits for such silent connections when it shuts down.
func newTrackedClient(maxConns int) (*http.Client, *connTracker) {
	t := &connTracker{conns: map[*trackedConn]struct{}{}}
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		Proxy: nil,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return t.add(c)
		},
		MaxIdleConns:        0,
		MaxIdleConnsPerHost: 100000,
		MaxConnsPerHost:     maxConns,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	return &http.Client{Transport: tr}, t
}

// connTracker knows a client's open connections.
type connTracker struct {
	mu     sync.Mutex
	conns  map[*trackedConn]struct{}
	closed bool
}

type trackedConn struct {
	net.Conn
	t *connTracker
}

func (c *trackedConn) Close() error {
	c.t.mu.Lock()
	delete(c.t.conns, c)
	c.t.mu.Unlock()
	return c.Conn.Close()
}

var errClientClosed = errors.New("bench: the run's client is closed")

func (t *connTracker) add(c net.Conn) (net.Conn, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		c.Close()
		return nil, errClientClosed
	}
	tc := &trackedConn{Conn: c, t: t}
	t.conns[tc] = struct{}{}
	return tc, nil
}

// closeAll closes every connection and refuses new ones.
func (t *connTracker) closeAll() {
	t.mu.Lock()
	t.closed = true
	conns := make([]net.Conn, 0, len(t.conns))
	for c := range t.conns {
		conns = append(conns, c.Conn)
	}
	clear(t.conns)
	t.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

// requester sends a run's requests to one target.
type requester struct {
	client    *http.Client
	base      string // scheme://host[:port], without /v1
	chat      bool
	stream    bool
	model     string
	timeout   time.Duration
	pollEvery time.Duration
	jobSSE    bool // follow jobs through their event streams
	jobAccept bool // follow no job: a record ends with its acceptance
}

// baseURL strips a trailing slash and /v1 from a target URL.
func baseURL(target string) string {
	t := strings.TrimRight(target, "/")
	return strings.TrimSuffix(t, "/v1")
}

func (r *requester) path() string {
	if r.chat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

type streamOpts struct {
	IncludeUsage bool `json:"include_usage"`
}

type chatMsg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type reqBody struct {
	Model         string      `json:"model"`
	Prompt        string      `json:"prompt,omitempty"`
	Messages      []chatMsg   `json:"messages,omitempty"`
	MaxTokens     int         `json:"max_tokens"`
	Temperature   float64     `json:"temperature"`
	IgnoreEOS     bool        `json:"ignore_eos,omitempty"`
	Stream        bool        `json:"stream,omitempty"`
	StreamOptions *streamOpts `json:"stream_options,omitempty"`
}

func (r *requester) body(it item, ignoreEOS, stream bool) []byte {
	b := reqBody{Model: r.model, MaxTokens: it.outputLen, IgnoreEOS: ignoreEOS, Stream: stream}
	switch {
	case r.chat && it.messages != nil:
		b.Messages = it.messages
	case r.chat:
		b.Messages = []chatMsg{{Role: "user", Content: it.prompt}}
	default:
		b.Prompt = it.prompt
	}
	if stream {
		b.StreamOptions = &streamOpts{IncludeUsage: true}
	}
	out, _ := json.Marshal(b)
	return out
}

var readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 16<<10) }}

// send makes one request and fills rec's timings, tokens and outcome. start
// is the instant latency is measured from (the intended send time).
func (r *requester) send(ctx context.Context, key string, it item, ignoreEOS bool, start time.Time, rec *Record) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.base+r.path(), bytes.NewReader(r.body(it, ignoreEOS, r.stream)))
	if err != nil {
		rec.fail(ErrClient, 0, err.Error())
		return
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	rec.Sent = time.Since(start) + rec.Intended
	resp, err := r.client.Do(req)
	if err != nil {
		rec.E2EL = time.Since(start)
		rec.failErr(ctx, err)
		return
	}
	defer resp.Body.Close()
	rec.Status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		msg := errorMessage(resp.Body)
		rec.E2EL = time.Since(start)
		rec.fail(classify(resp.StatusCode), resp.StatusCode, msg)
		return
	}
	if !r.stream {
		r.readWhole(ctx, resp.Body, start, rec)
		return
	}
	r.readStream(ctx, resp.Body, start, rec)
}

// readWhole reads a non-streaming answer: one body with usage.
func (r *requester) readWhole(ctx context.Context, body io.Reader, start time.Time, rec *Record) {
	b, err := io.ReadAll(body)
	rec.E2EL = time.Since(start)
	if err != nil {
		rec.failErr(ctx, err)
		return
	}
	var v struct {
		Usage *usage `json:"usage"`
	}
	if err := json.Unmarshal(b, &v); err != nil || v.Usage == nil {
		rec.fail(ErrStream, rec.Status, "answer without usage")
		return
	}
	rec.InputTokens, rec.OutputTokens = v.Usage.PromptTokens, v.Usage.CompletionTokens
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// readStream reads server-sent events: the first chunk with text gives
// TTFT, the gaps between later text chunks are the ITLs, and the usage chunk
// (stream_options.include_usage) gives the token counts; without one, the
// text chunks are counted.
func (r *requester) readStream(ctx context.Context, body io.Reader, start time.Time, rec *Record) {
	br := readers.Get().(*bufio.Reader)
	br.Reset(body)
	defer func() { br.Reset(nil); readers.Put(br) }()
	var (
		chunks int
		last   time.Time
		done   bool
		end    time.Time // when [DONE] came: the end, whatever the body's close waits for
		u      *usage
	)
	for {
		line, err := br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			// A line longer than the buffer: keep the rest of it.
			rest, err2 := br.ReadBytes('\n')
			line, err = append(append([]byte(nil), line...), rest...), err2
		}
		if len(line) > 0 {
			data, ok := bytes.CutPrefix(line, []byte("data:"))
			if ok {
				data = bytes.TrimSpace(data)
				now := time.Now()
				switch {
				case bytes.Equal(data, []byte("[DONE]")):
					done, end = true, now
				case isErrorEvent(data):
					rec.E2EL = now.Sub(start)
					rec.fail(ErrStream, rec.Status, errorText(data))
					return
				default:
					if hasText(data) {
						if chunks == 0 {
							rec.TTFT = now.Sub(start)
						} else {
							rec.ITLs = append(rec.ITLs, now.Sub(last))
						}
						last = now
						chunks++
					}
					if hasUsage(data) {
						var v struct {
							Usage *usage `json:"usage"`
						}
						if json.Unmarshal(data, &v) == nil && v.Usage != nil {
							u = v.Usage
						}
					}
				}
			}
		}
		if done {
			// Read the body's end, so that the connection is reused: a
			// response closed before its end closes its connection.
			_, _ = io.Copy(io.Discard, br)
			break
		}
		if err != nil {
			rec.E2EL = time.Since(start)
			if errors.Is(err, io.EOF) {
				rec.fail(ErrStream, rec.Status, "stream ended before [DONE]")
			} else {
				rec.failErr(ctx, err)
			}
			return
		}
	}
	rec.E2EL = end.Sub(start)
	if chunks == 0 {
		// As vLLM's benchmark counts it: a stream that never carried
		// text has no time to first token, and failed.
		rec.fail(ErrStream, rec.Status, "stream ended without a chunk of text")
		return
	}
	if u != nil {
		rec.InputTokens, rec.OutputTokens = u.PromptTokens, u.CompletionTokens
	} else {
		rec.OutputTokens = chunks
	}
	if rec.OutputTokens > 1 {
		rec.TPOT = (rec.E2EL - rec.TTFT) / time.Duration(rec.OutputTokens-1)
	}
}

// hasText reports whether a chunk carries generated text: a non-empty
// "text" (completions) or "content" / "reasoning_content" (chat) string.
func hasText(data []byte) bool {
	for _, key := range [...]string{`"text":`, `"content":`, `"reasoning_content":`} {
		rest := data
		for {
			i := bytes.Index(rest, []byte(key))
			if i < 0 {
				break
			}
			rest = bytes.TrimLeft(rest[i+len(key):], " ")
			if len(rest) >= 2 && rest[0] == '"' && rest[1] != '"' {
				return true
			}
		}
	}
	return false
}

// hasUsage reports whether a chunk has a non-null usage object.
func hasUsage(data []byte) bool {
	i := bytes.Index(data, []byte(`"usage":`))
	if i < 0 {
		return false
	}
	rest := bytes.TrimLeft(data[i+len(`"usage":`):], " ")
	return len(rest) > 0 && rest[0] == '{'
}

// isErrorEvent reports whether a data line is an error object (vLLM's
// nested one, or an OpenAI-style error event).
func isErrorEvent(data []byte) bool {
	return bytes.HasPrefix(data, []byte(`{"error"`)) || bytes.HasPrefix(data, []byte(`{"object":"error"`)) ||
		(bytes.Contains(data, []byte(`"error":{`)) && !bytes.Contains(data, []byte(`"choices"`)))
}

// errorMessage reads an error body's message (OpenAI's or vLLM's shape),
// or its first bytes.
func errorMessage(body io.Reader) string {
	b, _ := io.ReadAll(io.LimitReader(body, 4096))
	return errorText(b)
}

func errorText(b []byte) string {
	var v struct {
		Error struct {
			Message string          `json:"message"`
			Code    json.RawMessage `json:"code"`
		} `json:"error"`
		Message string `json:"message"`
	}
	msg := strings.TrimSpace(string(b))
	if json.Unmarshal(b, &v) == nil {
		switch {
		case v.Error.Message != "":
			msg = v.Error.Message
			if c := strings.Trim(string(v.Error.Code), `"`); c != "" && c != "null" {
				msg = c + ": " + msg
			}
		case v.Message != "":
			msg = v.Message
		}
	}
	if len(msg) > 200 {
		msg = msg[:200]
	}
	return msg
}

// jsonCall makes one small JSON request and decodes a 2xx answer into out.
func (r *requester) jsonCall(ctx context.Context, method, path, key, idemKey string, body []byte, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, r.base+path, rd)
	if err != nil {
		return 0, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if idemKey != "" {
		req.Header.Set("Idempotency-Key", idemKey)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return resp.StatusCode, fmt.Errorf("decode %s: %w", path, err)
	}
	return resp.StatusCode, nil
}

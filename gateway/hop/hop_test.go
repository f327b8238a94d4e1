package hop

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// server is a backend that counts the connections it accepted.
type server struct {
	*httptest.Server
	conns  atomic.Int64
	closed atomic.Int64
}

func newServer(t *testing.T, h http.HandlerFunc) *server {
	t.Helper()
	s := &server{}
	s.Server = httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			s.conns.Add(1)
		case http.StateClosed:
			s.closed.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s
}

func newTransport(t *testing.T) *Transport {
	t.Helper()
	tr := New(&http.Transport{}, 4, time.Minute)
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

func post(t *testing.T, c *http.Client, url, body string) (int, string) {
	t.Helper()
	resp, err := c.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("post: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return resp.StatusCode, string(b)
}

func echo(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	w.Header().Set("X-Method", r.Method)
	fmt.Fprintf(w, "%s %s %s", r.Method, r.URL.Path, b)
}

func TestForwardsAndReusesConnection(t *testing.T) {
	srv := newServer(t, echo)
	tr := newTransport(t)
	c := &http.Client{Transport: tr}
	for i := range 5 {
		code, got := post(t, c, srv.URL+"/v1/completions", fmt.Sprintf(`{"n":%d}`, i))
		if want := fmt.Sprintf(`POST /v1/completions {"n":%d}`, i); code != 200 || got != want {
			t.Fatalf("request %d: got %d %q, want 200 %q", i, code, got, want)
		}
	}
	if n := srv.conns.Load(); n != 1 {
		t.Fatalf("5 sequential requests opened %d connections, want 1", n)
	}
}

func TestStreamedAnswerThenReuse(t *testing.T) {
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
		}
	})
	tr := newTransport(t)
	c := &http.Client{Transport: tr}
	for range 2 {
		resp, err := c.Post(srv.URL, "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		if resp.TransferEncoding == nil || resp.TransferEncoding[0] != "chunked" {
			t.Fatalf("transfer encoding %v, want chunked", resp.TransferEncoding)
		}
		sc := bufio.NewScanner(resp.Body)
		var lines []string
		for sc.Scan() {
			if sc.Text() != "" {
				lines = append(lines, sc.Text())
			}
		}
		resp.Body.Close()
		if got := strings.Join(lines, ","); got != "data: 0,data: 1,data: 2" {
			t.Fatalf("stream read %q", got)
		}
	}
	if n := srv.conns.Load(); n != 1 {
		t.Fatalf("two whole streams opened %d connections, want 1", n)
	}
}

func TestBodyCutShortClosesConnection(t *testing.T) {
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, strings.Repeat("x", 100_000))
	})
	tr := newTransport(t)
	c := &http.Client{Transport: tr}
	resp, err := c.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 10)
	if _, err := io.ReadFull(resp.Body, buf); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// The rest of the first answer is on that connection: reusing it
	// would read it as the second answer's head.
	if code, got := post(t, c, srv.URL, ""); code != 200 || len(got) != 100_000 {
		t.Fatalf("after a cut body: %d, %d bytes", code, len(got))
	}
	if n := srv.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (the cut one is not reused)", n)
	}
}

func TestConnectionCloseIsHonoured(t *testing.T) {
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		echo(w, r)
	})
	tr := newTransport(t)
	c := &http.Client{Transport: tr}
	for range 3 {
		if code, _ := post(t, c, srv.URL, "{}"); code != 200 {
			t.Fatalf("status %d", code)
		}
	}
	if n := srv.conns.Load(); n != 3 {
		t.Fatalf("%d connections for 3 answers that said close, want 3", n)
	}
}

// A backend that closes idle connections (uvicorn does after 5 s) must
// cost no request: the peek sees the close and a fresh connection goes.
func TestIdleConnectionClosedByBackend(t *testing.T) {
	srv := newServer(t, echo)
	tr := newTransport(t)
	c := &http.Client{Transport: tr}
	for i := range 3 {
		if code, _ := post(t, c, srv.URL, "{}"); code != 200 {
			t.Fatalf("request %d: status %d", i, code)
		}
		srv.CloseClientConnections()
		waitIdleClosed(t, tr)
	}
	if n := srv.conns.Load(); n != 3 {
		t.Fatalf("%d connections, want 3", n)
	}
}

// waitIdleClosed waits until the pool's idle connections read the
// backend's close, as the peek will.
func waitIdleClosed(t *testing.T, tr *Transport) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		tr.mu.Lock()
		dead := true
		for _, list := range tr.idle {
			for _, c := range list {
				if alive(c.nc) {
					dead = false
				}
			}
		}
		tr.mu.Unlock()
		if dead {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the backend's close never reached the idle connection")
		}
		time.Sleep(time.Millisecond)
	}
}

// brokenOnce is a connection whose first write fails with nothing sent,
// as on a connection the backend closed between the peek and the write.
type brokenOnce struct {
	*net.TCPConn
	fail *atomic.Bool
}

func (b brokenOnce) Write(p []byte) (int, error) {
	if b.fail.CompareAndSwap(true, false) {
		return 0, &net.OpError{Op: "write", Net: "tcp", Err: errors.New("broken pipe")}
	}
	return b.TCPConn.Write(p)
}

func TestNotSentOnReusedConnectionGoesAgain(t *testing.T) {
	srv := newServer(t, echo)
	tr := newTransport(t)
	var fail atomic.Bool
	dial := tr.dial
	tr.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		nc, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return brokenOnce{TCPConn: nc.(*net.TCPConn), fail: &fail}, nil
	}
	c := &http.Client{Transport: tr}
	if code, _ := post(t, c, srv.URL, "{}"); code != 200 {
		t.Fatalf("status %d", code)
	}
	fail.Store(true)
	if code, got := post(t, c, srv.URL, `{"again":1}`); code != 200 || got != `POST / {"again":1}` {
		t.Fatalf("after a write that never left: %d %q", code, got)
	}
	if n := srv.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2", n)
	}

	// A fresh connection that fails the same way is not tried again: the
	// error goes back, marked as a write.
	tr.CloseIdleConnections()
	fail.Store(true)
	_, err := c.Post(srv.URL, "application/json", strings.NewReader("{}"))
	if err == nil || !strings.Contains(err.Error(), "broken pipe") {
		t.Fatalf("fresh connection's failed write: %v", err)
	}
}

func TestCancelWhileWaitingForHead(t *testing.T) {
	release, arrived := make(chan struct{}), make(chan struct{})
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		close(arrived)
		<-release
	})
	defer close(release)
	tr := newTransport(t)
	ctx, cancel := context.WithCancelCause(context.Background())
	stalled := errors.New("stalled")
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("{}"))
	done := make(chan error, 1)
	go func() {
		_, err := tr.RoundTrip(req)
		done <- err
	}()
	<-arrived
	cancel(stalled)
	if err := <-done; !errors.Is(err, stalled) {
		t.Fatalf("cancelled exchange returned %v, want the cancellation's cause", err)
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, list := range tr.idle {
		if len(list) > 0 {
			t.Fatal("a cancelled exchange's connection went back to the pool")
		}
	}
}

func TestCancelWhileReadingStream(t *testing.T) {
	release := make(chan struct{})
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		<-release
	})
	defer close(release)
	tr := newTransport(t)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if line, _ := br.ReadString('\n'); line != "data: first\n" {
		t.Fatalf("first line %q", line)
	}
	cancel()
	if _, err := io.ReadAll(br); !errors.Is(err, context.Canceled) {
		t.Fatalf("read after cancel: %v, want context.Canceled", err)
	}
}

func TestInformationalAnswersAreSkipped(t *testing.T) {
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		echo(w, r)
	})
	tr := newTransport(t)
	if code, got := post(t, &http.Client{Transport: tr}, srv.URL+"/x", "b"); code != 200 || got != "POST /x b" {
		t.Fatalf("got %d %q", code, got)
	}
}

// An answer sent before the request was read, as a refusal is, reaches
// the caller even though the backend closed before the body was written.
func TestEarlyAnswerReachesCaller(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		// Read the head only, answer, and close with the body unread.
		br := bufio.NewReader(nc)
		for {
			line, err := br.ReadString('\n')
			if err != nil || line == "\r\n" {
				break
			}
		}
		fmt.Fprint(nc, "HTTP/1.1 401 Unauthorized\r\nContent-Length: 6\r\nConnection: close\r\n\r\nno key")
		nc.(*net.TCPConn).CloseWrite()
		time.Sleep(50 * time.Millisecond)
		nc.Close()
	}()
	tr := newTransport(t)
	tr.MaxBody = 8 << 20
	body := strings.Repeat("x", 8<<20)
	code, got := post(t, &http.Client{Transport: tr}, "http://"+ln.Addr().String(), body)
	if code != 401 || got != "no key" {
		t.Fatalf("got %d %q, want the backend's 401", code, got)
	}
}

func TestFallbackTakesWhatHopDoesNot(t *testing.T) {
	srv := newServer(t, echo)
	tls := httptest.NewTLSServer(http.HandlerFunc(echo))
	defer tls.Close()
	cases := []struct {
		name string
		req  func() *http.Request
	}{
		{"https", func() *http.Request {
			r, _ := http.NewRequest(http.MethodPost, tls.URL, strings.NewReader("{}"))
			return r
		}},
		{"body over MaxBody", func() *http.Request {
			r, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(strings.Repeat("x", 64<<10+1)))
			return r
		}},
		{"body of unknown length", func() *http.Request {
			r, _ := http.NewRequest(http.MethodPost, srv.URL, io.NopCloser(strings.NewReader("{}")))
			return r
		}},
		{"expect 100-continue", func() *http.Request {
			r, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("{}"))
			r.Header.Set("Expect", "100-continue")
			return r
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr := newTransport(t)
			tr.Fallback.TLSClientConfig = tls.Client().Transport.(*http.Transport).TLSClientConfig
			resp, err := tr.RoundTrip(tc.req())
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			tr.mu.Lock()
			n := len(tr.idle)
			tr.mu.Unlock()
			if resp.StatusCode != 200 || n != 0 {
				t.Fatalf("status %d, %d hosts in hop's pool, want 200 through the fallback", resp.StatusCode, n)
			}
		})
	}
}

// A dial failure keeps net's shape: the gateway classifies it as never
// sent by its Op.
func TestDialErrorIsAnOpError(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	tr := newTransport(t)
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr, strings.NewReader("{}"))
	_, err := tr.RoundTrip(req)
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "dial" {
		t.Fatalf("dial to a closed port: %v, want a *net.OpError with Op dial", err)
	}
}

func TestIdlePoolIsBounded(t *testing.T) {
	release := make(chan struct{})
	var started sync.WaitGroup
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		started.Done()
		<-release
		echo(w, r)
	})
	tr := newTransport(t)
	c := &http.Client{Transport: tr}
	const n = 10
	started.Add(n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			resp, err := c.Post(srv.URL, "application/json", strings.NewReader("{}"))
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	started.Wait()
	close(release)
	wg.Wait()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for _, list := range tr.idle {
		if len(list) != tr.MaxIdlePerHost {
			t.Fatalf("%d idle connections kept, want MaxIdlePerHost %d", len(list), tr.MaxIdlePerHost)
		}
	}
}

func TestConcurrentExchanges(t *testing.T) {
	srv := newServer(t, echo)
	tr := newTransport(t)
	c := &http.Client{Transport: tr}
	var wg sync.WaitGroup
	var bad atomic.Int64
	for g := range 8 {
		wg.Go(func() {
			for i := range 50 {
				want := fmt.Sprintf("POST /%d/%d x", g, i)
				resp, err := c.Post(fmt.Sprintf("%s/%d/%d", srv.URL, g, i), "text/plain", strings.NewReader("x"))
				if err != nil {
					bad.Add(1)
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if string(b) != want {
					bad.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if bad.Load() != 0 {
		t.Fatalf("%d of 400 exchanges failed or crossed", bad.Load())
	}
	if n := srv.conns.Load(); n > 8 {
		t.Fatalf("%d connections for 8 concurrent callers", n)
	}
}

// Idle connections past IdleTimeout are closed as later requests end,
// those of a backend no longer called too.
func TestExpiredIdleConnectionsAreClosed(t *testing.T) {
	gone := newServer(t, echo)
	other := newServer(t, echo)
	tr := newTransport(t)
	now := time.Unix(1_000_000, 0)
	tr.now = func() time.Time { return now }
	c := &http.Client{Transport: tr}
	post(t, c, gone.URL, "{}")
	now = now.Add(tr.IdleTimeout / 2)
	post(t, c, other.URL, "{}")
	if gone.closed.Load() != 0 {
		t.Fatal("a connection idle for half IdleTimeout was closed")
	}
	now = now.Add(tr.IdleTimeout)
	post(t, c, other.URL, "{}")
	deadline := time.Now().Add(5 * time.Second)
	for gone.closed.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the expired connection to a backend no longer called stayed open")
		}
		time.Sleep(time.Millisecond)
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.idle) != 1 || len(tr.idle[other.Listener.Addr().String()]) != 1 {
		t.Fatalf("pool after the sweep: %v, want one connection to the backend still called", tr.idle)
	}
}

// rawBackend answers every connection's first request head with answer.
func rawBackend(t *testing.T, answer func(nc net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer nc.Close()
				br := bufio.NewReader(nc)
				for {
					line, err := br.ReadString('\n')
					if err != nil || line == "\r\n" {
						break
					}
				}
				answer(nc)
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

func TestEndlessHeadIsCut(t *testing.T) {
	url := rawBackend(t, func(nc net.Conn) {
		fmt.Fprint(nc, "HTTP/1.1 200 OK\r\n")
		line := "X-Pad: " + strings.Repeat("a", 1000) + "\r\n"
		for range 2000 { // 2 MB of header
			if _, err := fmt.Fprint(nc, line); err != nil {
				return
			}
		}
	})
	tr := newTransport(t)
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	if _, err := tr.RoundTrip(req); !errors.Is(err, errHeadTooLong) {
		t.Fatalf("a 2 MB head: %v, want errHeadTooLong", err)
	}
}

func TestInformationalAnswersAreBounded(t *testing.T) {
	url := rawBackend(t, func(nc net.Conn) {
		for range 6 {
			fmt.Fprint(nc, "HTTP/1.1 103 Early Hints\r\n\r\n")
		}
		fmt.Fprint(nc, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
	})
	tr := newTransport(t)
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	if _, err := tr.RoundTrip(req); err == nil || !strings.Contains(err.Error(), "1xx") {
		t.Fatalf("six 1xx answers: %v, want an error", err)
	}
}

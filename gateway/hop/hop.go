package hop

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Transport is an http.RoundTripper; see the package comment. The zero
// value is not usable: use New.
type Transport struct {
	// Fallback takes what Transport does not.
	Fallback *http.Transport
	// MaxBody is the largest request body sent on the caller's goroutine.
	MaxBody int64
	// MaxIdlePerHost bounds the idle connections kept for each backend.
	MaxIdlePerHost int
	// IdleTimeout closes a connection idle for longer instead of reusing it.
	IdleTimeout time.Duration

	dial func(ctx context.Context, network, addr string) (net.Conn, error)
	now  func() time.Time

	mu    sync.Mutex
	idle  map[string][]*conn // per host:port, most recently used last
	swept time.Time          // when put last closed the expired ones
}

// New returns a Transport with kvgate's settings: up to maxIdlePerHost
// idle connections a backend, reused for up to idleTimeout, bodies up to
// 64 KiB on the caller's goroutine. CloseIdleConnections closes the
// fallback's idle connections too.
func New(fallback *http.Transport, maxIdlePerHost int, idleTimeout time.Duration) *Transport {
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	return &Transport{
		Fallback: fallback, MaxBody: 64 << 10, MaxIdlePerHost: maxIdlePerHost, IdleTimeout: idleTimeout,
		dial: d.DialContext, now: time.Now, idle: map[string][]*conn{},
	}
}

type conn struct {
	nc     net.Conn
	br     *bufio.Reader // reads through conn.Read
	bw     *bufio.Writer // writes through conn.Write
	wrote  int64         // bytes the kernel took, to tell a request that never left
	head   int64         // bytes an answer's head may still take; 0 once it is read
	idleAt time.Time
	reused bool
}

// maxHead bounds what an answer's head may take from the wire, 1xx
// answers included, as net/http's Transport bounds it (there 10 MB): a
// broken backend's endless header costs an error, not the memory.
const maxHead = 1 << 20

// errHeadTooLong is what a read past maxHead, while the head is read, fails with.
var errHeadTooLong = errors.New("backend's answer head is over 1 MiB")

func (c *conn) Read(p []byte) (int, error) {
	if c.head == 0 {
		return c.nc.Read(p)
	}
	if int64(len(p)) > c.head {
		p = p[:c.head]
	}
	n, err := c.nc.Read(p)
	c.head -= int64(n)
	if c.head == 0 && err == nil {
		// The limit is spent while the head is still being read: the next
		// read would be unbounded, so this one fails.
		return n, errHeadTooLong
	}
	return n, err
}

func (c *conn) Write(p []byte) (int, error) {
	n, err := c.nc.Write(p)
	c.wrote += int64(n)
	return n, err
}

// errNotSent marks a failure before any byte of the request reached a
// reused connection: the backend had closed it, and the request may go
// again on a fresh one.
var errNotSent = errors.New("request not sent")

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !t.handles(req) {
		return t.Fallback.RoundTrip(req)
	}
	key := keyOf(req)
	for {
		c, err := t.get(req.Context(), key)
		if err != nil {
			closeBody(req)
			if req.Context().Err() != nil {
				return nil, context.Cause(req.Context())
			}
			return nil, err
		}
		resp, err := t.exchange(req, c, key)
		if err == nil {
			return resp, nil
		}
		if !errors.Is(err, errNotSent) || !c.reused || req.GetBody == nil {
			return nil, err
		}
		// The idle connection was gone; nothing of the request went.
		body, gerr := req.GetBody()
		if gerr != nil {
			return nil, err
		}
		req = req.Clone(req.Context())
		req.Body = body
	}
}

// handles reports whether a request goes on the caller's goroutine.
func (t *Transport) handles(req *http.Request) bool {
	if !peekable || req.URL.Scheme != "http" || req.Header.Get("Upgrade") != "" || req.Header.Get("Expect") != "" {
		return false
	}
	if req.Body == nil || req.Body == http.NoBody {
		return true
	}
	return req.ContentLength > 0 && req.ContentLength <= t.MaxBody
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// get takes the newest live idle connection to key, or dials one.
func (t *Transport) get(ctx context.Context, key string) (*conn, error) {
	now := t.now()
	for {
		t.mu.Lock()
		list := t.idle[key]
		if len(list) == 0 {
			t.mu.Unlock()
			break
		}
		c := list[len(list)-1]
		list[len(list)-1] = nil
		t.idle[key] = list[:len(list)-1]
		t.mu.Unlock()
		if now.Sub(c.idleAt) <= t.IdleTimeout && c.br.Buffered() == 0 && alive(c.nc) {
			c.reused = true
			return c, nil
		}
		_ = c.nc.Close()
	}
	nc, err := t.dial(ctx, "tcp", key)
	if err != nil {
		return nil, err
	}
	c := &conn{nc: nc}
	c.br = bufio.NewReaderSize(c, 16<<10)
	c.bw = bufio.NewWriterSize(c, 8<<10)
	return c, nil
}

// put returns a connection whose exchange ended cleanly to the pool.
// Every half IdleTimeout it also closes the connections idle for longer,
// those of backends no longer called among them: no goroutine watches
// the pool, so an expired connection lasts at most one and a half
// IdleTimeouts while any request ends.
func (t *Transport) put(key string, c *conn) {
	now := t.now()
	c.idleAt = now
	var drop []*conn
	t.mu.Lock()
	if now.Sub(t.swept) >= t.IdleTimeout/2 {
		t.swept = now
		drop = t.expiredLocked(now)
	}
	if list := t.idle[key]; len(list) < t.MaxIdlePerHost {
		t.idle[key] = append(list, c)
	} else {
		drop = append(drop, c)
	}
	t.mu.Unlock()
	for _, c := range drop {
		_ = c.nc.Close()
	}
}

// expiredLocked takes the connections idle for longer than IdleTimeout
// out of the pool: the front of each list, which is oldest first.
func (t *Transport) expiredLocked(now time.Time) []*conn {
	var old []*conn
	for key, list := range t.idle {
		i := 0
		for i < len(list) && now.Sub(list[i].idleAt) > t.IdleTimeout {
			i++
		}
		if i == 0 {
			continue
		}
		old = append(old, list[:i]...)
		if i == len(list) {
			delete(t.idle, key)
			continue
		}
		n := copy(list, list[i:])
		clear(list[n:])
		t.idle[key] = list[:n]
	}
	return old
}

// CloseIdleConnections closes the idle connections, the fallback's too.
func (t *Transport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = map[string][]*conn{}
	t.mu.Unlock()
	for _, list := range idle {
		for _, c := range list {
			_ = c.nc.Close()
		}
	}
	t.Fallback.CloseIdleConnections()
}

// longAgo is the deadline that unblocks a connection's reads and writes.
var longAgo = time.Unix(1, 0)

// exchange writes req on c and reads its answer's head. The answer's
// body reads from c, and hands c back when it ends.
func (t *Transport) exchange(req *http.Request, c *conn, key string) (*http.Response, error) {
	ctx := req.Context()
	// A cancelled request unblocks whatever its goroutine waits for on c;
	// c is then closed, never reused.
	stop := context.AfterFunc(ctx, func() { _ = c.nc.SetDeadline(longAgo) })
	fail := func(err error) (*http.Response, error) {
		stop()
		_ = c.nc.Close()
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, err
	}
	before := c.wrote
	err := req.Write(c.bw)
	if err == nil {
		err = c.bw.Flush()
	}
	if err != nil && c.wrote == before {
		return fail(fmt.Errorf("%w: %w", errNotSent, err))
	}
	// A backend that answers before it has read the whole request (a
	// refusal) and then closes breaks the write; its answer may still be
	// there to read, and is what the caller needs to see.
	wrote := err
	var resp *http.Response
	// The head's bound counts what the buffer already holds of it.
	c.head = maxHead - int64(c.br.Buffered())
	for informational := 0; ; informational++ {
		resp, err = http.ReadResponse(c.br, req)
		if err != nil {
			switch {
			case c.head == 0: // spent: the parser may have met a cut line first
				err = errHeadTooLong
			case wrote != nil:
				err = wrote
			}
			return fail(err)
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
		// 1xx: informational, with no body; the answer follows. As many
		// as net/http's Transport takes.
		if informational == 5 {
			return fail(errors.New("backend sent too many 1xx answers"))
		}
	}
	c.head = 0
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return fail(errors.New("backend switched protocols unasked"))
	}
	b := &body{rc: resp.Body, t: t, c: c, key: key, stop: stop, keep: wrote == nil && !resp.Close && !req.Close, ctx: ctx}
	if resp.Body == http.NoBody {
		b.finish(true)
		return resp, nil
	}
	resp.Body = b
	return resp, nil
}

func keyOf(req *http.Request) string {
	if req.URL.Port() == "" {
		return net.JoinHostPort(req.URL.Hostname(), "80")
	}
	return req.URL.Host
}

// body is an answer's body read from its connection, which it hands back
// to the pool at its end, or closes when it is cut short.
type body struct {
	rc   io.ReadCloser
	t    *Transport
	c    *conn
	key  string
	stop func() bool
	keep bool
	ctx  context.Context
	done atomic.Bool
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	switch {
	case err == io.EOF:
		b.finish(true)
	case err != nil:
		b.finish(false)
		if b.ctx.Err() != nil {
			err = context.Cause(b.ctx)
		}
	}
	return n, err
}

// Close ends the exchange; a body not read to its end closes the
// connection, since what is left of it is still on the wire.
func (b *body) Close() error {
	b.finish(false)
	return nil
}

func (b *body) finish(whole bool) {
	if b.done.Swap(true) {
		return
	}
	// stop reports false when the cancellation already fired: the
	// connection's deadline is spent, and so is the connection.
	if b.stop() && whole && b.keep {
		b.t.put(b.key, b.c)
		return
	}
	_ = b.c.nc.Close()
}

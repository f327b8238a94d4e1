package baseline

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"time"
)

// RoundRobin is a pass-through proxy that sends each request to the next
// backend in turn, whatever their state. Responses, server-sent event
// streams included, are relayed as they arrive. It is safe for concurrent
// use and has no goroutines of its own.
type RoundRobin struct {
	proxies []*httputil.ReverseProxy
	next    atomic.Uint64
}

// NewRoundRobin returns a round-robin router over the backends' base URLs
// (such as http://10.0.0.5:8000). It fails on an empty list or a URL that
// does not parse.
func NewRoundRobin(backends []string) (*RoundRobin, error) {
	proxies, err := newProxies(backends, newTransport())
	if err != nil {
		return nil, err
	}
	return &RoundRobin{proxies: proxies}, nil
}

// ServeHTTP relays r to the next backend.
func (rr *RoundRobin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	i := (rr.next.Add(1) - 1) % uint64(len(rr.proxies))
	rr.proxies[i].ServeHTTP(w, r)
}

// newTransport is a pooled client transport sized for a benchmark's
// thousands of concurrent requests; it never retries on its own.
func newTransport() *http.Transport {
	return &http.Transport{
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 2048,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
}

// newProxies builds one reverse proxy per backend. Each flushes every write
// at once (FlushInterval -1), so a stream's tokens reach the client as the
// backend sends them; a backend that cannot be reached gets 502 with an
// OpenAI-style error body.
func newProxies(backends []string, tr http.RoundTripper) ([]*httputil.ReverseProxy, error) {
	if len(backends) == 0 {
		return nil, errors.New("baseline: no backends")
	}
	proxies := make([]*httputil.ReverseProxy, len(backends))
	for i, b := range backends {
		u, err := url.Parse(strings.TrimRight(b, "/"))
		if err != nil || u.Scheme == "" || u.Host == "" {
			return nil, fmt.Errorf("baseline: backend %q is not a base URL", b)
		}
		p := httputil.NewSingleHostReverseProxy(u)
		p.Transport = tr
		p.FlushInterval = -1
		p.ErrorLog = slog.NewLogLogger(slog.DiscardHandler, slog.LevelError)
		p.ErrorHandler = func(w http.ResponseWriter, r *http.Request, err error) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			fmt.Fprintf(w, `{"error":{"message":%q,"type":"upstream_error","code":"bad_gateway"}}`+"\n",
				"backend "+u.Host+" failed: "+err.Error())
		}
		proxies[i] = p
	}
	return proxies, nil
}

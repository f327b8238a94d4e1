package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gateway/hop"
)

// bareProxy is the floor that BenchmarkGatewayOverhead sets kvgate beside:
// the reverse proxy a Go programmer would write in a few lines (the
// standard library's httputil.ReverseProxy, flushing every write as a
// stream needs, with the same idle pool as the load generator), doing
// nothing but forward. Whatever it adds over calling the backend directly
// is the cost of a hop through net/http's server and client on the
// machine at hand; what kvgate adds beyond it is kvgate's own work
// (admission, tenancy, usage, metrics) less what its client saves.
//
// It runs as a child of the test binary (`bare-proxy --backend URL`) and
// prints its address as kvgate does. With --hop it forwards through
// gateway/hop's Transport, kvgate's backend client, instead: the same
// floor with the client that kvgate uses.
func bareProxy(args []string, stdout io.Writer) int {
	fs := flag.NewFlagSet("bare-proxy", flag.ContinueOnError)
	backend := fs.String("backend", "", "the backend's base URL")
	useHop := fs.Bool("hop", false, "forward with gateway/hop's Transport instead of net/http's")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	u, err := url.Parse(*backend)
	if err != nil || u.Host == "" {
		fmt.Fprintln(stdout, "bare-proxy: --backend must be a URL")
		return 2
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1
	rp.Transport = &http.Transport{MaxIdleConnsPerHost: 512}
	if *useHop {
		rp.Transport = hop.New(&http.Transport{MaxIdleConnsPerHost: 512}, 512, 90*time.Second)
	}
	rp.ErrorLog = log.New(io.Discard, "", 0)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(http.ResponseWriter, *http.Request) {})
	mux.Handle("/", rp)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(stdout, err)
		return 1
	}
	fmt.Fprintf(stdout, "bare-proxy listening on http://%s\n", ln.Addr())
	_ = http.Serve(ln, mux) // until the benchmark stops the process
	return 0
}

// TestBareProxyForwards checks the floor forwards a request and its
// answer whole, as kvgate does, so that the benchmark compares like with
// like.
func TestBareProxyForwards(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s %s %s", r.Method, r.URL.Path, body)
	}))
	defer backend.Close()
	for _, flags := range [][]string{nil, {"--hop"}} {
		bare := child(t, append([]string{"bare-proxy", "--backend", backend.URL}, flags...)...)
		resp, err := http.Post(bare+"/v1/completions", "application/json", strings.NewReader(`{"x":1}`))
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if want := `POST /v1/completions {"x":1}`; resp.StatusCode != http.StatusOK || string(got) != want {
			t.Fatalf("%v: got %d %q, want 200 %q", flags, resp.StatusCode, got, want)
		}
	}
}

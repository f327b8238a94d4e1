package main

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestServeCutsSlowHeaders: serve's HTTP server holds against clients that
// never finish their request's headers: one that sends them a byte at a
// time is cut off by the header timeout without an answer, and headers
// over the size limit get 431.
func TestServeCutsSlowHeaders(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the 10 s header timeout")
	}
	base, _ := startServe(t, "--data-dir", t.TempDir())
	addr := strings.TrimPrefix(base, "http://")

	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	type answer struct {
		n   int64
		err error
	}
	closed := make(chan answer, 1)
	go func() {
		n, err := io.Copy(io.Discard, conn)
		closed <- answer{n, err}
	}()
	if _, err := io.WriteString(conn, "GET /v1/models HTTP/1.1\r\nHost: kvgate\r\nX-Slow: "); err != nil {
		t.Fatal(err)
	}
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	giveUp := time.After(time.Minute) // the timeout is 10 s
trickle:
	for {
		select {
		case a := <-closed:
			if a.n != 0 {
				t.Errorf("the server answered %d bytes to unfinished headers, want a silent close", a.n)
			}
			break trickle
		case <-tick.C:
			if _, err := conn.Write([]byte("a")); err != nil {
				break trickle // closed by the server
			}
		case <-giveUp:
			t.Fatal("a client trickling its headers kept its connection for a minute")
		}
	}

	req, _ := http.NewRequest(http.MethodGet, base+"/v1/models", nil)
	req.Header.Set("X-Big", strings.Repeat("a", 2<<20))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("2 MiB of headers: %d, want 431", resp.StatusCode)
	}
}

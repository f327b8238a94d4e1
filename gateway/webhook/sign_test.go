package webhook

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

// TestSignSpecVector checks Sign against the test vector of the Standard
// Webhooks reference Go library (libraries/go/webhook_test.go,
// TestWebhookSign).
func TestSignSpecVector(t *testing.T) {
	key, err := ParseSecret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
	if err != nil {
		t.Fatal(err)
	}
	got := Sign([][]byte{key}, "msg_p5jXN8AQM9LWM0D4loKWxJek", time.Unix(1614265330, 0), []byte(`{"test": 2432232314}`))
	const want = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
	if got != want {
		t.Fatalf("Sign = %q, want the spec's %q", got, want)
	}
}

func TestSignRotation(t *testing.T) {
	a, b := mustSecret(t), mustSecret(t)
	ts := time.Unix(1700000000, 999_000_000) // sub-second part is dropped
	body := []byte(`{"type":"job.succeeded"}`)
	one := Sign([][]byte{a}, "whd_1", ts, body)
	two := Sign([][]byte{a, b}, "whd_1", ts, body)
	parts := strings.Split(two, " ")
	if len(parts) != 2 || parts[0] != one {
		t.Fatalf("two secrets give %q; want the one-secret signature %q first, then a second", two, one)
	}
	if parts[1] == parts[0] {
		t.Fatal("two secrets gave the same signature")
	}
	for i, key := range [][]byte{a, b} {
		mac := hmac.New(sha256.New, key)
		mac.Write([]byte("whd_1.1700000000." + string(body)))
		if want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil)); parts[i] != want {
			t.Errorf("signature %d = %q, want %q", i, parts[i], want)
		}
	}
	// Any change to id, timestamp or body changes the signature.
	for name, s := range map[string]string{
		"id":        Sign([][]byte{a}, "whd_2", ts, body),
		"timestamp": Sign([][]byte{a}, "whd_1", ts.Add(time.Second), body),
		"body":      Sign([][]byte{a}, "whd_1", ts, append(bytes.Clone(body), ' ')),
	} {
		if s == one {
			t.Errorf("changing the %s left the signature unchanged", name)
		}
	}
	if got := Sign(nil, "whd_1", ts, body); got != "" {
		t.Errorf("no secrets: Sign = %q, want \"\"", got)
	}
}

func mustSecret(t testing.TB) []byte {
	t.Helper()
	s, err := NewSecret()
	if err != nil {
		t.Fatal(err)
	}
	k, err := ParseSecret(s)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestNewSecret(t *testing.T) {
	seen := map[string]bool{}
	for range 100 {
		s, err := NewSecret()
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(s, "whsec_") || len(s) != len("whsec_")+32 {
			t.Fatalf("NewSecret = %q, want whsec_ and 32 base64 characters (24 bytes)", s)
		}
		k, err := ParseSecret(s)
		if err != nil || len(k) != 24 {
			t.Fatalf("ParseSecret(%q) = %d bytes, %v", s, len(k), err)
		}
		if seen[s] {
			t.Fatalf("NewSecret repeated %q", s)
		}
		seen[s] = true
	}
}

func TestParseSecretRefuses(t *testing.T) {
	b64 := func(n int) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, n)) }
	for _, tc := range []struct{ name, in string }{
		{"empty", ""},
		{"no prefix", b64(24)},
		{"wrong prefix", "whsk_" + b64(24)},
		{"prefix only", "whsec_"},
		{"not base64", "whsec_not*base64!!"},
		{"url-safe base64", "whsec_" + strings.NewReplacer("+", "-", "/", "_").Replace(base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{0xfb, 0xff}, 12)))},
		{"too short", "whsec_" + b64(23)},
		{"too long", "whsec_" + b64(65)},
	} {
		if k, err := ParseSecret(tc.in); err == nil {
			t.Errorf("%s: ParseSecret(%q) = %x, want an error", tc.name, tc.in, k)
		}
	}
	for _, n := range []int{24, 32, 64} {
		if k, err := ParseSecret("whsec_" + b64(n)); err != nil || len(k) != n {
			t.Errorf("%d bytes: ParseSecret = %d bytes, %v", n, len(k), err)
		}
	}
}

func TestReadCapped(t *testing.T) {
	for _, tc := range []struct {
		n, max int64
		trunc  bool
	}{
		{0, 10, false}, {9, 10, false}, {10, 10, false}, {11, 10, true}, {1 << 20, 10, true}, {5, 0, true}, {0, 0, false},
	} {
		src := &countingReader{r: io.LimitReader(zeros{}, tc.n)}
		b, trunc, err := ReadCapped(src, tc.max)
		if err != nil {
			t.Fatal(err)
		}
		wantLen := min(tc.n, tc.max)
		if int64(len(b)) != wantLen || trunc != tc.trunc {
			t.Errorf("n=%d max=%d: got %d bytes, truncated=%v; want %d, %v", tc.n, tc.max, len(b), trunc, wantLen, tc.trunc)
		}
		if src.n > tc.max+1 {
			t.Errorf("n=%d max=%d: read %d bytes from the source, more than max+1", tc.n, tc.max, src.n)
		}
	}
	boom := errors.New("boom")
	b, trunc, err := ReadCapped(io.MultiReader(strings.NewReader("abc"), iotest.ErrReader(boom)), 10)
	if !errors.Is(err, boom) || string(b) != "abc" || trunc {
		t.Errorf("read error: got %q, %v, %v; want the bytes read and the error", b, trunc, err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// BenchmarkSign signs a 1 KiB body with one secret and with two (during
// rotation); "naive" is the straightforward Sprintf-and-EncodeToString
// version of one signature, for comparison.
func BenchmarkSign(b *testing.B) {
	body := bytes.Repeat([]byte(`{"k":"v"}`), 1024/9)
	ts := time.Unix(1700000000, 0)
	for _, n := range []int{1, 2} {
		keys := make([][]byte, n)
		for i := range keys {
			keys[i] = mustSecret(b)
		}
		b.Run(map[int]string{1: "secrets=1", 2: "secrets=2"}[n], func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				Sign(keys, "whd_01JDXKQ4Y5Z6", ts, body)
			}
		})
	}
	key := mustSecret(b)
	b.Run("naive", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(body)))
		for b.Loop() {
			mac := hmac.New(sha256.New, key)
			mac.Write([]byte(fmt.Sprintf("%s.%d.%s", "whd_01JDXKQ4Y5Z6", ts.Unix(), body)))
			_ = "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
		}
	})
}

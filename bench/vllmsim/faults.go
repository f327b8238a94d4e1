package vllmsim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
)

// Faults are the failure modes the simulator can inject into inference
// requests, for reliability tests. Rates are probabilities per request in
// [0, 1]. They can be set at start (Config.Faults, the sim command's flags)
// and changed at run time with GET and PUT /admin/faults.
type Faults struct {
	// RateLimitRate answers 429 with a Retry-After of RetryAfterSeconds.
	RateLimitRate     float64 `json:"rate_limit_rate"`
	RetryAfterSeconds int     `json:"retry_after_seconds"`
	// ServerErrorRate answers 500; UnavailableRate answers 503.
	ServerErrorRate float64 `json:"server_error_rate"`
	UnavailableRate float64 `json:"unavailable_rate"`
	// DropRate cuts the connection mid-response: a stream after some of
	// its tokens, a non-streaming request before its body.
	DropRate float64 `json:"drop_rate"`
	// HangRate accepts the request and never answers until the client
	// gives up.
	HangRate float64 `json:"hang_rate"`
	// MalformedRate answers 200 with a truncated JSON body.
	MalformedRate float64 `json:"malformed_rate"`
	// SlowFirstTokenRate delays a request by SlowFirstTokenSeconds
	// (simulated) before it reaches the engine, so its first token is late.
	SlowFirstTokenRate    float64 `json:"slow_first_token_rate"`
	SlowFirstTokenSeconds float64 `json:"slow_first_token_seconds"`
	// InvalidJSONRate makes a structured answer (response_format,
	// guided_json) break its schema (structured.go).
	InvalidJSONRate float64 `json:"invalid_json_rate"`
	// Dead kills the engine: /health answers 503 and every request fails
	// until Dead is set back to false.
	Dead bool `json:"dead"`
	// Match, when set, limits the rates above to inference requests whose
	// body contains it (a marker in a prompt, say): the others run as if
	// no fault were set. It stands for a server that fails one kind of
	// request. Dead ignores it.
	Match string `json:"match,omitempty"`
}

// Validate reports whether every rate is a probability.
func (f Faults) Validate() error {
	for name, v := range map[string]float64{
		"rate_limit_rate": f.RateLimitRate, "server_error_rate": f.ServerErrorRate,
		"unavailable_rate": f.UnavailableRate, "drop_rate": f.DropRate, "hang_rate": f.HangRate,
		"malformed_rate": f.MalformedRate, "slow_first_token_rate": f.SlowFirstTokenRate,
		"invalid_json_rate": f.InvalidJSONRate,
	} {
		if !(v >= 0 && v <= 1) {
			return fmt.Errorf("%s %g is not a probability in [0, 1]", name, v)
		}
	}
	if f.RetryAfterSeconds < 0 || f.SlowFirstTokenSeconds < 0 {
		return errors.New("retry_after_seconds and slow_first_token_seconds must not be negative")
	}
	return nil
}

type fault uint8

const (
	faultNone fault = iota
	fault429
	fault500
	fault503
	faultDrop
	faultHang
	faultMalformed
)

// faultSet holds the live fault settings and draws from them.
type faultSet struct {
	mu  sync.Mutex
	cur Faults
	rng *rand.Rand
}

func newFaultSet(f Faults, seed uint64) *faultSet {
	return &faultSet{cur: f, rng: rand.New(rand.NewPCG(seed, 0xfa017))}
}

func (s *faultSet) get() Faults {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

func (s *faultSet) set(f Faults) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cur = f
}

// draw picks at most one fault for a request, and the extra delay before
// its first token; r is the request, for Match.
func (s *faultSet) draw(r *http.Request) (fault, float64, Faults) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.cur
	if matched, _ := r.Context().Value(faultMatchKey{}).(bool); f.Match != "" && !matched {
		return faultNone, 0, f
	}
	delay := 0.0
	if f.SlowFirstTokenRate > 0 && s.rng.Float64() < f.SlowFirstTokenRate {
		delay = f.SlowFirstTokenSeconds
	}
	x := s.rng.Float64()
	for _, c := range []struct {
		rate float64
		kind fault
	}{
		{f.RateLimitRate, fault429}, {f.ServerErrorRate, fault500}, {f.UnavailableRate, fault503},
		{f.DropRate, faultDrop}, {f.HangRate, faultHang}, {f.MalformedRate, faultMalformed},
	} {
		if x < c.rate {
			return c.kind, delay, f
		}
		x -= c.rate
	}
	return faultNone, delay, f
}

// faultMatchKey marks, in an inference request's context, a body that
// contains the faults' Match.
type faultMatchKey struct{}

// withFaultMatch reads the body of an inference request, while the faults
// have a Match, to mark whether it matches; the handler reads the body
// again as it came.
func (s *Sim) withFaultMatch(r *http.Request) *http.Request {
	match := s.faults.get().Match
	if match == "" {
		return r
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, s.cfg.MaxBodyBytes))
	r.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(b), errReader{err}, r.Body), r.Body}
	return r.WithContext(context.WithValue(r.Context(), faultMatchKey{}, bytes.Contains(b, []byte(match))))
}

// errReader returns err, or nothing when err is nil.
type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	return 0, io.EOF
}

// dropAfter picks how many tokens a dropped stream delivers first.
func (s *faultSet) dropAfter(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n <= 1 {
		return 0
	}
	return s.rng.IntN(n)
}

func (s *Sim) handleFaults(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodPut || r.Method == http.MethodPost {
		var f Faults
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&f); err != nil {
			writeError(w, http.StatusBadRequest, "invalid fault settings: "+err.Error())
			return
		}
		if err := f.Validate(); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
		s.SetFaults(f)
	}
	writeJSON(w, http.StatusOK, s.Faults())
}

// SetFaults replaces the fault settings; Dead kills or revives the engine.
func (s *Sim) SetFaults(f Faults) {
	s.faults.set(f)
	if f.Dead {
		s.eng.Kill()
	} else {
		s.eng.Revive()
	}
}

// Faults returns the current fault settings.
func (s *Sim) Faults() Faults {
	f := s.faults.get()
	f.Dead = s.eng.Dead()
	return f
}

package bench

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

func TestWordsAreOneTokenEach(t *testing.T) {
	// The simulator's tokenizer (and Llama-3's) makes each word one token,
	// so synthetic prompts are as long as asked.
	text := wordText(newRNG(1, "w"), 500)
	if n := len(vllmsim.Tokenize(text, false)); n != 500 {
		t.Errorf("500 words tokenize to %d tokens", n)
	}
}

func TestDistDraws(t *testing.T) {
	const n = 100000
	for _, tc := range []struct {
		d         Dist
		mean, std float64
		lo, hi    int
	}{
		{Dist{Kind: DistFixed, Mean: 128}, 128, 0, 128, 128},
		{Dist{Kind: DistUniform, Min: 10, Max: 30}, 20, math.Sqrt((21*21 - 1) / 12.0), 10, 30},
		{Dist{Kind: DistNormal, Mean: 500, StdDev: 50}, 500, 50, 1, 1 << 30},
		{Dist{Kind: DistLogNormal, Mean: 300, StdDev: 150}, 300, 150, 1, 1 << 30},
		{Dist{Kind: DistNormal, Mean: 100, StdDev: 80, Min: 20, Max: 150}, -1, -1, 20, 150},
	} {
		rng := newRNG(2, "d")
		v := make([]float64, n)
		for i := range v {
			x := tc.d.draw(rng)
			if x < tc.lo || x > tc.hi {
				t.Fatalf("%+v drew %d outside [%d, %d]", tc.d, x, tc.lo, tc.hi)
			}
			v[i] = float64(x)
		}
		m, s := meanStd(v)
		if tc.mean >= 0 && (math.Abs(m-tc.mean) > 0.01*tc.mean || math.Abs(s-tc.std) > 0.03*math.Max(tc.std, 1)) {
			t.Errorf("%+v: mean %.2f std %.2f, want %.2f and %.2f", tc.d, m, s, tc.mean, tc.std)
		}
	}
}

func TestShareGPTLoads(t *testing.T) {
	items, err := loadShareGPT("testdata/sharegpt-sample.json")
	if err != nil {
		t.Fatal(err)
	}
	// c3's prompt is under 4 tokens and c5 has no answer; c2 counts its
	// first turn and answer only.
	if len(items) != 4 {
		t.Fatalf("%d usable conversations, want 4 (c1, c2, c4, c6)", len(items))
	}
	for _, it := range items {
		if it.outputLen < 4 || it.inputLen < 4 || !strings.HasSuffix(it.prompt, "?") && !strings.HasSuffix(it.prompt, ".") || it.prompt == "Now make it sadder." {
			t.Errorf("item %+v", it)
		}
	}
	if _, err := loadShareGPT("testdata/trace.jsonl"); err == nil {
		t.Error("a JSONL file read as ShareGPT")
	}
}

func TestTraceKeepsPrefixSharing(t *testing.T) {
	items, err := loadTrace("testdata/trace.jsonl", 42)
	if err != nil {
		t.Fatal(err)
	}
	if len(items) != 5 {
		t.Fatalf("%d trace items, want 5", len(items))
	}
	if items[1].at != 50*time.Millisecond || items[4].at != 260*time.Millisecond {
		t.Errorf("offsets %v, %v; want 50ms and 260ms", items[1].at, items[4].at)
	}
	tok := func(i int) []int { return vllmsim.Tokenize(items[i].prompt, false) }
	if n := len(tok(0)); n != 600 {
		t.Errorf("first prompt has %d tokens, want 600", n)
	}
	// Requests 0 and 1 share block 0 (512 tokens) and no more; 0 and 4
	// share blocks 0 and the first 8 tokens of block 1.
	a, b, e := tok(0), tok(1), tok(4)
	if !equalInts(a[:512], b[:512]) || equalInts(a[512:520], b[512:520]) {
		t.Error("requests 0 and 1 should share exactly their first block")
	}
	if !equalInts(a[:520], e[:520]) {
		t.Error("requests 0 and 4 should share 520 tokens")
	}
	if items[3].prompt != "Summarize the plot of Hamlet in two sentences." {
		t.Errorf("a trace prompt was not kept: %q", items[3].prompt)
	}
	bad := filepath.Join(t.TempDir(), "bad.jsonl")
	_ = os.WriteFile(bad, []byte(`{"timestamp": 10, "input_length": 5, "output_length": 1}`+"\n"+`{"timestamp": 5, "input_length": 5, "output_length": 1}`+"\n"), 0o644)
	if _, err := loadTrace(bad, 1); err == nil {
		t.Error("a trace going backwards in time loaded")
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestPrefixWorkload(t *testing.T) {
	w, err := Workload{Kind: DatasetPrefix, PrefixLen: 64, PrefixGroups: 3, Input: Dist{Mean: 10}, Output: Dist{Mean: 5}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	src, err := newSource(w, newRNG(1, "p"))
	if err != nil {
		t.Fatal(err)
	}
	prefixes := map[string]int{}
	for range 300 {
		it := src.draw()
		toks := vllmsim.Tokenize(it.prompt, false)
		if len(toks) != 74 || it.inputLen != 74 || it.outputLen != 5 {
			t.Fatalf("prompt of %d tokens (%d intended), want 74", len(toks), it.inputLen)
		}
		prefixes[strings.Join(strings.Fields(it.prompt)[:64], " ")]++
	}
	if len(prefixes) != 3 {
		t.Errorf("%d distinct prefixes, want 3", len(prefixes))
	}
	for p, n := range prefixes {
		if n < 60 {
			t.Errorf("prefix %.20q used %d times of 300", p, n)
		}
	}
}

func TestWorkloadValidation(t *testing.T) {
	for _, w := range []Workload{
		{Kind: "sonnet"},
		{Kind: DatasetShareGPT},
		{Kind: DatasetPrefix},
		{Input: Dist{Kind: DistUniform, Min: 5, Max: 2}},
		{Input: Dist{Kind: "zipf", Mean: 3}},
		{Output: Dist{Kind: DistNormal, Mean: 0.5}},
	} {
		if _, err := w.withDefaults(); err == nil {
			t.Errorf("workload %+v accepted", w)
		}
	}
}

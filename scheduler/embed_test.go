package scheduler

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

func TestEmbedBatches(t *testing.T) {
	raw := func(n, size int) []json.RawMessage {
		out := make([]json.RawMessage, n)
		for i := range out {
			out[i] = json.RawMessage(`"` + strings.Repeat("x", size) + `"`)
		}
		return out
	}
	for _, tc := range []struct {
		n, size int
		want    string
	}{
		{1, 10, "[{0 1}]"},
		{256, 10, "[{0 256}]"},
		{257, 10, "[{0 256} {256 257}]"},
		{600, 10, "[{0 256} {256 512} {512 600}]"},
		{5, EmbedBatchBytes / 2, "[{0 1} {1 2} {2 3} {3 4} {4 5}]"}, // two no longer fit in the bytes
		{2, EmbedBatchBytes * 2, "[{0 1} {1 2}]"},                   // one too large alone is a batch of its own
	} {
		if got := fmt.Sprint(embedBatches(raw(tc.n, tc.size))); got != tc.want {
			t.Errorf("%d inputs of %d bytes: %s, want %s", tc.n, tc.size, got, tc.want)
		}
	}
}

func TestSplitEmbeddings(t *testing.T) {
	for body, ok := range map[string]bool{
		`{"model":"m","input":["a","b"]}`:   true,
		`{"model":"m","input":[[1,2],[3]]}`: true,
		`{"model":"m","input":[1,2,3]}`:     false, // one input of token ids
		`{"model":"m","input":"one"}`:       false,
		`{"model":"m","input":[]}`:          false,
		`not json`:                          false,
	} {
		if _, _, got := splitEmbeddings([]byte(body)); got != ok {
			t.Errorf("%s: split %v, want %v", body, got, ok)
		}
	}
}

func TestMergeEmbeddings(t *testing.T) {
	batches := []embedBatch{{0, 2}, {2, 3}}
	parts := [][]byte{
		[]byte(`{"object":"list","model":"m","data":[{"object":"embedding","index":1,"embedding":[1]},{"object":"embedding","index":0,"embedding":[0]}],"usage":{"prompt_tokens":4,"total_tokens":4}}`),
		[]byte(`{"object":"list","model":"m","data":[{"object":"embedding","index":0,"embedding":[2]}],"usage":{"prompt_tokens":3,"total_tokens":3}}`),
	}
	read := make([]embedPart, len(parts))
	for i, p := range parts {
		var err error
		if read[i], err = readEmbedBatch(p, batches[i]); err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
	}
	b, err := mergeEmbeddings(read)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"object":"list","data":[{"embedding":[0],"index":0,"object":"embedding"},{"embedding":[1],"index":1,"object":"embedding"},{"embedding":[2],"index":2,"object":"embedding"}],"model":"m","usage":{"prompt_tokens":7,"total_tokens":7}}`
	if string(b) != want {
		t.Errorf("merged\n%s\nwant\n%s", b, want)
	}
	for _, bad := range [][]byte{
		[]byte(`{"data":[{"index":0}]}`),             // one embedding for two inputs
		[]byte(`{"data":[{"index":0},{"index":0}]}`), // an index twice
		[]byte(`{"data":[{"index":0},{"index":5}]}`), // out of range
		[]byte(`nope`),
	} {
		if _, err := readEmbedBatch(bad, batches[0]); err == nil {
			t.Errorf("%s read as batch 0's answer", bad)
		}
	}
}

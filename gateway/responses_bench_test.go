package gateway

import (
	"testing"
)

// A delta event as vLLM sends it (pydantic's model_dump_json: no spaces).
var benchDelta = []byte(`{"content_index":0,"delta":" hello","item_id":"msg_0123456789abcdef","logprobs":[],"output_index":0,"sequence_number":42,"type":"response.output_text.delta"}`)

// TestResponsesEventFastPath: the fast path and the full decode agree on
// deltas, and a text that holds the type's words is no delta.
func TestResponsesEventFastPath(t *testing.T) {
	if got, want := responsesEvent(benchDelta), parseResponsesEvent(benchDelta); got.typ != want.typ || got.delta != want.delta || !got.delta {
		t.Errorf("fast %+v, decoded %+v", got, want)
	}
	done := []byte(`{"content_index":0,"item_id":"m","logprobs":[],"output_index":0,"sequence_number":9,"text":"\"type\":\"response.output_text.delta\"","type":"response.output_text.done"}`)
	if ev := responsesEvent(done); ev.delta || ev.typ != "response.output_text.done" {
		t.Errorf("a done event whose text quotes a delta's type: %+v", ev)
	}
}

// BenchmarkResponsesEvent: what the relay spends on each token of a
// Responses stream, with the fast path and with a full decode.
func BenchmarkResponsesEvent(b *testing.B) {
	b.Run("fast", func(b *testing.B) {
		for b.Loop() {
			if !responsesEvent(benchDelta).delta {
				b.Fatal("not a delta")
			}
		}
	})
	b.Run("decode", func(b *testing.B) {
		for b.Loop() {
			if !parseResponsesEvent(benchDelta).delta {
				b.Fatal("not a delta")
			}
		}
	})
}

package gateway

import (
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"testing"
)

func TestWithStreamUsage(t *testing.T) {
	for _, tc := range []struct {
		body       string
		hasOptions bool
		want       map[string]any
	}{
		{`{"model":"m","stream":true}`, false, map[string]any{"model": "m", "stream": true, "stream_options": map[string]any{"include_usage": true}}},
		{` { }`, false, map[string]any{"stream_options": map[string]any{"include_usage": true}}},
		{`{"stream_options":{"include_usage":false,"continuous_usage_stats":true},"top_k":3}`, true,
			map[string]any{"top_k": 3.0, "stream_options": map[string]any{"include_usage": true}}},
		{`{"stream_options":null,"x":[1,2]}`, true, map[string]any{"x": []any{1.0, 2.0}, "stream_options": map[string]any{"include_usage": true}}},
	} {
		b, err := withStreamUsage([]byte(tc.body), tc.hasOptions)
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		var got map[string]any
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%s: invalid JSON out: %s", tc.body, b)
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s:\n got %v\nwant %v", tc.body, got, tc.want)
		}
	}
}

func TestEventData(t *testing.T) {
	for _, tc := range []struct{ event, want string }{
		{"data: {\"a\":1}\n\n", `{"a":1}`},
		{"data:{\"a\":1}\r\n\r\n", `{"a":1}`},
		{"data: [DONE]\n\n", "[DONE]"},
		{"event: x\ndata: y\n\n", "y"},
		{"data: a\ndata: b\n\n", "a\nb"},
		{": comment\n\n", ""},
		// A data line with an empty value, with its colon or without
		// (a field's whole line is its name), is a line of the data too,
		// as the client's parser reads it: not [DONE].
		{"data\ndata:[DONE]\n\n", "\n[DONE]"},
		{"data:\ndata: [DONE]\n\n", "\n[DONE]"},
		{"data: [DONE]\ndata\n\n", "[DONE]\n"},
	} {
		if got := string(eventData([]byte(tc.event))); got != tc.want {
			t.Errorf("eventData(%q) = %q, want %q", tc.event, got, tc.want)
		}
	}
}

// TestStreamOptionsNotAnObject: a stream_options that is not an object is
// a 400 naming it, as any field of the wrong type is.
func TestStreamOptionsNotAnObject(t *testing.T) {
	for _, opts := range []string{`"x"`, `5`, `[]`} {
		_, err := parseCall([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":`+opts+`}`), epChat)
		var api *apiError
		if !errors.As(err, &api) || api.status != http.StatusBadRequest || api.param != "stream_options" {
			t.Errorf("stream_options %s: %v (%+v), want a 400 naming stream_options", opts, err, api)
		}
	}
}

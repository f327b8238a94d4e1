package vllmsim

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

const invoiceSchema = `{"type": "object", "required": ["total", "currency", "line_items"],
	"properties": {
		"total": {"type": "number", "minimum": 0},
		"currency": {"type": "string", "enum": ["EUR", "USD"]},
		"issued": {"type": "string", "format": "date"},
		"count": {"type": "integer", "minimum": 1, "maximum": 3},
		"paid": {"type": "boolean"},
		"note": {"type": ["string", "null"], "minLength": 12},
		"supplier": {"$ref": "#/$defs/party"},
		"line_items": {"type": "array", "minItems": 2, "maxItems": 4,
			"items": {"type": "object", "required": ["amount"], "properties": {"amount": {"type": "number"}}}}
	},
	"$defs": {"party": {"type": "object", "required": ["name", "iban"],
		"properties": {"name": {"type": "string"}, "iban": {"type": "string", "maxLength": 4}}}},
	"additionalProperties": false}`

func compileTestSchema(t *testing.T, doc string) *jsonschema.Schema {
	t.Helper()
	v, err := jsonschema.UnmarshalJSON(strings.NewReader(doc))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("s.json", v); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile("s.json")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// content sends a chat request and returns its message content.
func (c simClient) content(t *testing.T, req map[string]any) string {
	t.Helper()
	res := c.do(t, http.MethodPost, "/v1/chat/completions", req)
	if res.status != http.StatusOK {
		t.Fatalf("status %d: %s", res.status, res.body)
	}
	var out struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(res.body, &out); err != nil || len(out.Choices) != 1 {
		t.Fatalf("answer %s: %v", res.body, err)
	}
	return out.Choices[0].Message.Content
}

func conforms(s *jsonschema.Schema, text string) bool {
	v, err := jsonschema.UnmarshalJSON(strings.NewReader(text))
	return err == nil && s.Validate(v) == nil
}

func TestStructuredOutputs(t *testing.T) {
	sim, c := startSim(t, Config{Profile: testProfile(t, 4096, 512), Seed: 7})
	schema := compileTestSchema(t, invoiceSchema)
	req := func(user string, format map[string]any) map[string]any {
		return map[string]any{"model": sim.model, "messages": chatMessages(user), "max_tokens": 8, "response_format": format}
	}
	jsonSchema := map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "invoice", "schema": json.RawMessage(invoiceSchema)}}

	seen := map[string]bool{}
	for _, user := range []string{"invoice one", "invoice two", "invoice three", "invoice four"} {
		a := c.content(t, req(user, jsonSchema))
		if !conforms(schema, a) {
			t.Errorf("%q: the answer %s does not conform to the schema", user, a)
		}
		if b := c.content(t, req(user, jsonSchema)); b != a {
			t.Errorf("%q: the same request answered %s, then %s", user, a, b)
		}
		seen[a] = true
	}
	if len(seen) < 2 {
		t.Errorf("four prompts got %d distinct answers; the output should follow the prompt", len(seen))
	}

	// guided_json, as a string and as an object, on a completion too.
	for _, g := range []any{invoiceSchema, json.RawMessage(invoiceSchema)} {
		a := c.content(t, map[string]any{"model": sim.model, "messages": chatMessages("guided"), "guided_json": g})
		if !conforms(schema, a) {
			t.Errorf("guided_json: %s does not conform", a)
		}
	}
	res := c.do(t, http.MethodPost, "/v1/completions", map[string]any{"model": sim.model, "prompt": "p", "max_tokens": 4, "guided_json": json.RawMessage(invoiceSchema)})
	var cmpl struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(res.body, &cmpl); err != nil || len(cmpl.Choices) != 1 || !conforms(schema, cmpl.Choices[0].Text) {
		t.Errorf("completion with guided_json: %d %s", res.status, res.body)
	}

	// json_object: any JSON object.
	a := c.content(t, req("obj", map[string]any{"type": "json_object"}))
	var obj map[string]any
	if err := json.Unmarshal([]byte(a), &obj); err != nil {
		t.Errorf("json_object answer %q is not a JSON object: %v", a, err)
	}
	// Without a format, free text as before.
	if a := c.content(t, req("free", nil)); json.Valid([]byte(a)) && strings.HasPrefix(a, "{") {
		t.Errorf("a request without response_format got JSON %q", a)
	}

	for _, bad := range []map[string]any{
		req("x", map[string]any{"type": "yaml"}),
		req("x", map[string]any{"type": "json_schema"}),
		req("x", map[string]any{"type": "json_schema", "json_schema": map[string]any{"schema": []int{1}}}),
		{"model": sim.model, "messages": chatMessages("x"), "stream": true, "response_format": jsonSchema},
	} {
		if res := c.do(t, http.MethodPost, "/v1/chat/completions", bad); res.status != http.StatusBadRequest {
			t.Errorf("%v: status %d, want 400: %s", bad["response_format"], res.status, res.body)
		}
	}
}

func TestInvalidJSONRate(t *testing.T) {
	sim, c := startSim(t, Config{Profile: testProfile(t, 4096, 512), Seed: 3})
	schema := compileTestSchema(t, invoiceSchema)
	format := map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "invoice", "schema": json.RawMessage(invoiceSchema)}}
	ask := func(i int) string {
		return c.content(t, map[string]any{"model": sim.model, "messages": chatMessages("doc " + strings.Repeat("x", i)), "max_tokens": 4, "response_format": format})
	}
	sim.SetFaults(Faults{InvalidJSONRate: 1})
	notJSON, wrongShape := 0, 0
	for i := range 20 {
		a := ask(i)
		switch {
		case conforms(schema, a):
			t.Errorf("with invalid_json_rate 1, %s conforms", a)
		case json.Valid([]byte(a)):
			wrongShape++
		default:
			notJSON++
		}
	}
	if notJSON == 0 || wrongShape == 0 {
		t.Errorf("invalid answers: %d not JSON, %d of the wrong shape; want both kinds", notJSON, wrongShape)
	}
	// The rate applies per request; free text is not touched by it.
	sim.SetFaults(Faults{InvalidJSONRate: 0.5})
	bad := 0
	for i := range 200 {
		if !conforms(schema, ask(i)) {
			bad++
		}
	}
	if bad < 60 || bad > 140 {
		t.Errorf("invalid_json_rate 0.5 broke %d of 200 answers", bad)
	}
	if err := (Faults{InvalidJSONRate: 1.5}).Validate(); err == nil {
		t.Error("invalid_json_rate 1.5 was accepted")
	}
	sim.SetFaults(Faults{})
	if a := ask(1); !conforms(schema, a) {
		t.Errorf("cleared, the answer %s does not conform", a)
	}
}

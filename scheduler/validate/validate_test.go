package validate

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

const invoicePolicy = `{"name": "invoice", "rules": [
	{"rule": "json"},
	{"rule": "schema", "schema": {"type": "object", "required": ["total", "currency"],
		"properties": {"total": {"type": "number"}, "currency": {"type": "string"}}}},
	{"rule": "enum", "pointer": "/currency", "values": ["EUR", "USD"]},
	{"rule": "sum", "items": "/line_items/*/amount", "total": "/total", "tolerance": 0.01},
	{"rule": "evidence", "pointer": "/supplier_iban"}
]}`

const invoiceSource = "Invoice from ACME GmbH, IBAN DE89 3704 0044 0532 0130 00.\nTotal due: 30.00 EUR"

type reasonKey struct{ rule, code, pointer string }

func keys(rs []Reason) []reasonKey {
	var out []reasonKey
	for _, r := range rs {
		if r.Message == "" {
			out = append(out, reasonKey{"MESSAGE MISSING", r.Code, r.Pointer})
			continue
		}
		out = append(out, reasonKey{r.Rule, r.Code, r.Pointer})
	}
	return out
}

func mustParse(t *testing.T, doc string) *Policy {
	t.Helper()
	p, err := Parse([]byte(doc))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return p
}

func TestCheckInvoice(t *testing.T) {
	p := mustParse(t, invoicePolicy)
	for _, tc := range []struct {
		name   string
		answer string
		source string
		want   []reasonKey
	}{
		{"passes", `{"total": 30.00, "currency": "EUR", "supplier_iban": "DE89 3704 0044 0532 0130 00",
			"line_items": [{"amount": 10.005}, {"amount": 19.999}]}`, invoiceSource, nil},
		{"not json", `{"total": 30`, invoiceSource, []reasonKey{{"json", "invalid_json", ""}}},
		{"prose around json", `Here it is: {"total": 1}`, invoiceSource, []reasonKey{{"json", "invalid_json", ""}}},
		{"schema required and type", `{"total": "thirty", "supplier_iban": "DE89 3704 0044 0532 0130 00"}`, invoiceSource,
			[]reasonKey{{"schema", "schema_violation", ""}, {"schema", "schema_violation", "/total"},
				{"enum", "missing", "/currency"}, {"sum", "not_a_number", "/total"}}},
		{"enum not allowed", `{"total": 0, "currency": "GBP", "supplier_iban": "DE89 3704 0044 0532 0130 00"}`, invoiceSource,
			[]reasonKey{{"enum", "not_allowed", "/currency"}}},
		{"sum off", `{"total": 30, "currency": "USD", "supplier_iban": "DE89 3704 0044 0532 0130 00",
			"line_items": [{"amount": 10}, {"amount": 19.5}]}`, invoiceSource, []reasonKey{{"sum", "sum_mismatch", "/total"}}},
		{"sum item not a number", `{"total": 30, "currency": "USD", "supplier_iban": "DE89 3704 0044 0532 0130 00",
			"line_items": [{"amount": 10}, {"amount": "20"}]}`, invoiceSource, []reasonKey{{"sum", "not_a_number", "/line_items/1/amount"}}},
		{"invented iban", `{"total": 0, "currency": "EUR", "supplier_iban": "DE00 0000 0000 0000 0000 00"}`, invoiceSource,
			[]reasonKey{{"evidence", "not_in_source", "/supplier_iban"}}},
		{"iban wrapped differently", `{"total": 0, "currency": "EUR", "supplier_iban": "DE89 3704\n0044  0532 0130 00"}`, invoiceSource, nil},
		{"iban missing", `{"total": 0, "currency": "EUR"}`, invoiceSource, []reasonKey{{"evidence", "missing", "/supplier_iban"}}},
		{"iban not a string", `{"total": 0, "currency": "EUR", "supplier_iban": 89}`, invoiceSource,
			[]reasonKey{{"evidence", "not_a_string", "/supplier_iban"}}},
		{"empty source", `{"total": 0, "currency": "EUR", "supplier_iban": "DE89"}`, "",
			[]reasonKey{{"evidence", "not_in_source", "/supplier_iban"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := keys(p.Check(Input{Answer: tc.answer, Source: tc.source}))
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("reasons %v, want %v", got, tc.want)
			}
		})
	}
}

func TestRuleJSON(t *testing.T) {
	p := mustParse(t, `{"name": "j", "rules": [{"rule": "json"}]}`)
	for answer, ok := range map[string]bool{
		`{}`: true, `[1, 2]`: true, `"s"`: true, `12.5`: true, `null`: true,
		``: false, `{`: false, `{} {}`: false, `{"a": 1,}`: false, `NaN`: false,
	} {
		if got := p.Check(Input{Answer: answer}); (len(got) == 0) != ok {
			t.Errorf("%q: reasons %v, want pass=%v", answer, got, ok)
		}
	}
}

func TestRuleSchema(t *testing.T) {
	own := `{"name": "s", "rules": [{"rule": "schema", "schema": {"type": "object", "required": ["a"],
		"properties": {"a": {"type": "integer", "minimum": 1}, "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
		"additionalProperties": false}}]}`
	fromRequest := `{"name": "s", "rules": [{"rule": "schema"}]}`
	reqSchema := json.RawMessage(`{"type": "object", "required": ["b"]}`)
	for _, tc := range []struct {
		name, policy, answer string
		request              json.RawMessage
		want                 []reasonKey
	}{
		{"conforms", own, `{"a": 2, "tags": ["x"]}`, nil, nil},
		{"minimum", own, `{"a": 0}`, nil, []reasonKey{{"schema", "schema_violation", "/a"}}},
		{"nested item", own, `{"a": 1, "tags": ["x", "z"]}`, nil, []reasonKey{{"schema", "schema_violation", "/tags/1"}}},
		{"extra property", own, `{"a": 1, "b": 1}`, nil, []reasonKey{{"schema", "schema_violation", ""}}},
		{"the policy's schema wins", own, `{"a": 1}`, reqSchema, nil},
		{"the request's schema", fromRequest, `{"b": true}`, reqSchema, nil},
		{"the request's schema fails", fromRequest, `{"a": true}`, reqSchema, []reasonKey{{"schema", "schema_violation", ""}}},
		{"no schema anywhere", fromRequest, `{}`, nil, []reasonKey{{"schema", "no_schema", ""}}},
		{"the request's schema broken", fromRequest, `{}`, json.RawMessage(`{"type": 12}`), []reasonKey{{"schema", "no_schema", ""}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := keys(mustParse(t, tc.policy).Check(Input{Answer: tc.answer, RequestSchema: tc.request}))
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("reasons %v, want %v", got, tc.want)
			}
		})
	}
}

func TestRuleEnum(t *testing.T) {
	p := mustParse(t, `{"name": "e", "rules": [{"rule": "enum", "pointer": "/items/*/c", "values": ["EUR", 1, null, {"k": [true]}]}]}`)
	for _, tc := range []struct {
		answer string
		want   []reasonKey
	}{
		{`{"items": [{"c": "EUR"}, {"c": 1.0}, {"c": null}, {"c": {"k": [true]}}]}`, nil},
		{`{"items": [{"c": "EUR"}, {"c": "eur"}]}`, []reasonKey{{"enum", "not_allowed", "/items/1/c"}}},
		{`{"items": [{"c": 2}, {"c": {"k": [false]}}]}`, []reasonKey{{"enum", "not_allowed", "/items/0/c"}, {"enum", "not_allowed", "/items/1/c"}}},
		{`{"items": []}`, []reasonKey{{"enum", "missing", "/items/*/c"}}},
		{`{"items": {"c": "EUR"}}`, []reasonKey{{"enum", "missing", "/items/*/c"}}},
		{`[]`, []reasonKey{{"enum", "missing", "/items/*/c"}}},
	} {
		if got := keys(p.Check(Input{Answer: tc.answer})); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: reasons %v, want %v", tc.answer, got, tc.want)
		}
	}
	// Escaped pointer segments name keys with / and ~.
	p = mustParse(t, `{"name": "e", "rules": [{"rule": "enum", "pointer": "/a~1b/~0c", "values": [1]}]}`)
	if got := p.Check(Input{Answer: `{"a/b": {"~c": 2}}`}); len(got) != 1 || got[0].Pointer != "/a~1b/~0c" || got[0].Code != CodeNotAllowed {
		t.Errorf("escaped pointer: %v", got)
	}
}

func TestRuleSum(t *testing.T) {
	p := mustParse(t, `{"name": "s", "rules": [{"rule": "sum", "items": "/l/*/a", "total": "/t", "tolerance": 0.01}]}`)
	exact := mustParse(t, `{"name": "s", "rules": [{"rule": "sum", "items": "/l/*", "total": "/t"}]}`)
	for _, tc := range []struct {
		p      *Policy
		answer string
		want   []reasonKey
	}{
		{p, `{"t": 0.3, "l": [{"a": 0.1}, {"a": 0.2}]}`, nil},
		{p, `{"t": 30.01, "l": [{"a": 10}, {"a": 20}]}`, nil},
		{p, `{"t": 30.02, "l": [{"a": 10}, {"a": 20}]}`, []reasonKey{{"sum", "sum_mismatch", "/t"}}},
		{p, `{"t": 0, "l": []}`, nil},
		{p, `{"t": 5}`, []reasonKey{{"sum", "sum_mismatch", "/t"}}},
		{p, `{"l": [{"a": 1}]}`, []reasonKey{{"sum", "missing", "/t"}}},
		{p, `{"t": "1", "l": [{"a": 1}]}`, []reasonKey{{"sum", "not_a_number", "/t"}}},
		{p, `{"t": 1, "l": [{"a": true}, {"a": 1}]}`, []reasonKey{{"sum", "not_a_number", "/l/0/a"}}},
		{exact, `{"t": 1e2, "l": [99.99999999999999999, 0.00000000000000001]}`, nil},
		{exact, `{"t": 100, "l": [99.9999999, 0.0000002]}`, []reasonKey{{"sum", "sum_mismatch", "/t"}}},
	} {
		if got := keys(tc.p.Check(Input{Answer: tc.answer})); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: reasons %v, want %v", tc.answer, got, tc.want)
		}
	}
}

func TestRuleEvidence(t *testing.T) {
	p := mustParse(t, `{"name": "ev", "rules": [{"rule": "evidence", "pointer": "/quotes/*"}]}`)
	src := "Page 3: the term is   twelve months.\nPage 4: notice is 30 days."
	for _, tc := range []struct {
		answer string
		want   []reasonKey
	}{
		{`{"quotes": ["the term is twelve months.", "notice is 30 days"]}`, nil},
		{`{"quotes": ["notice is 60 days", "Page 3"]}`, []reasonKey{{"evidence", "not_in_source", "/quotes/0"}}},
		{`{"quotes": ["  ", 3]}`, []reasonKey{{"evidence", "not_in_source", "/quotes/0"}, {"evidence", "not_a_string", "/quotes/1"}}},
		{`{"quotes": []}`, []reasonKey{{"evidence", "missing", "/quotes/*"}}},
	} {
		if got := keys(p.Check(Input{Answer: tc.answer, Source: src})); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: reasons %v, want %v", tc.answer, got, tc.want)
		}
	}
}

func TestParseRejects(t *testing.T) {
	for _, tc := range []struct{ doc, want string }{
		{`{"name": "x", "rules": []}`, "at least one rule"},
		{`{"name": "x", "rules": [{"rule": "regex"}]}`, "unknown rule"},
		{`{"name": "x", "rules": [{"rule": "json", "extra": 1}]}`, "unknown field"},
		{`{"name": "x", "rules": [{"rule": "enum", "pointer": "currency", "values": ["EUR"]}]}`, "not a JSON pointer"},
		{`{"name": "x", "rules": [{"rule": "enum", "pointer": "/c~2", "values": ["EUR"]}]}`, "~ must be followed"},
		{`{"name": "x", "rules": [{"rule": "enum", "pointer": "/c"}]}`, "at least one value"},
		{`{"name": "x", "rules": [{"rule": "sum", "items": "/a/*", "total": "/t/*"}]}`, "without a wildcard"},
		{`{"name": "x", "rules": [{"rule": "sum", "items": "/a/*", "total": "/t", "tolerance": -1}]}`, "negative"},
		{`{"name": "x", "rules": [{"rule": "schema", "schema": {"type": "nope"}}]}`, "does not compile"},
		{`{"name": "x", "rules": [{"rule": "schema", "schema": {"$ref": "file:///etc/passwd"}}]}`, "self-contained"},
		{`{"name": "x", "rules": [{"rule": "schema", "schema": {"$ref": "https://example.com/s.json"}}]}`, "self-contained"},
		{`{"name": "x", "rules": [{"rule": "json"}]} {}`, "trailing"},
		{`[1]`, "not a valid policy"},
	} {
		_, err := Parse([]byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.doc, err, tc.want)
		}
	}
}

func TestRequestParts(t *testing.T) {
	r, err := ParseRequest([]byte(`{"model": "m", "messages": [{"role": "system", "content": "be terse"},
		{"role": "user", "content": "IBAN DE89"}, {"role": "user", "content": [{"type": "text", "text": "page 2"}, {"type": "image_url"}]}],
		"response_format": {"type": "json_schema", "json_schema": {"name": "inv", "schema": {"type": "object"}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Source(); got != "IBAN DE89\npage 2\n" {
		t.Errorf("source %q", got)
	}
	if got := string(r.Schema()); got != `{"type": "object"}` {
		t.Errorf("schema %s", got)
	}
	r, _ = ParseRequest([]byte(`{"prompt": "the text", "guided_json": "{\"type\": \"array\"}"}`))
	if r.Source() != "the text" || string(r.Schema()) != `{"type": "array"}` {
		t.Errorf("completion: source %q schema %s", r.Source(), r.Schema())
	}
	r, _ = ParseRequest([]byte(`{"prompt": "x", "response_format": {"type": "json_object"}}`))
	if r.Schema() != nil {
		t.Errorf("json_object has no schema, got %s", r.Schema())
	}
	for body, want := range map[string]string{
		`{"choices": [{"message": {"role": "assistant", "content": "{\"a\":1}"}}]}`: `{"a":1}`,
		`{"choices": [{"text": "[1]"}]}`:                                            `[1]`,
	} {
		if got, err := Answer([]byte(body)); err != nil || got != want {
			t.Errorf("Answer(%s) = %q, %v", body, got, err)
		}
	}
	for _, body := range []string{`{"choices": []}`, `{"choices": [{"message": {"content": null}}]}`, `nope`} {
		if _, err := Answer([]byte(body)); err == nil {
			t.Errorf("Answer(%s) had no error", body)
		}
	}
}

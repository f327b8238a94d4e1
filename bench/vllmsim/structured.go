package vllmsim

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// Structured outputs, the way vLLM's guided decoding answers them: a
// request with response_format {"type": "json_object"}, {"type":
// "json_schema", "json_schema": {"schema": ...}} or vLLM's guided_json
// gets JSON for its content instead of sampled words. The JSON is built
// from the schema, deterministically: seeded by the simulator's seed and
// the prompt, like its other output, so the same request gets the same
// answer. The fault rate invalid_json_rate makes a structured answer
// break its schema on purpose (half the time not JSON at all, half the
// time JSON of the wrong shape), so that validation's failing paths can
// be tested. The token counts are the engine's, as for any answer.

// structuredFields are the request fields that ask for structured output.
type structuredFields struct {
	ResponseFormat *struct {
		Type       string `json:"type"`
		JSONSchema *struct {
			Name   string          `json:"name"`
			Schema json.RawMessage `json:"schema"`
		} `json:"json_schema"`
	} `json:"response_format"`
	GuidedJSON json.RawMessage `json:"guided_json"`
}

// structuredSpec is what a request asked for: JSON, to a schema or to
// none (schema nil).
type structuredSpec struct {
	schema map[string]any
}

// spec reads what the request asked for: nil for free text, an error
// (the request's 400) for a format the simulator does not know or a
// schema that is not a JSON object.
func (f structuredFields) spec() (*structuredSpec, error) {
	raw := json.RawMessage(nil)
	switch {
	case len(f.GuidedJSON) > 0 && string(f.GuidedJSON) != "null":
		raw = f.GuidedJSON
		var s string
		if json.Unmarshal(raw, &s) == nil { // vLLM takes the schema as a string too
			raw = json.RawMessage(s)
		}
	case f.ResponseFormat == nil:
		return nil, nil
	case f.ResponseFormat.Type == "text" || f.ResponseFormat.Type == "":
		return nil, nil
	case f.ResponseFormat.Type == "json_object":
		return &structuredSpec{}, nil
	case f.ResponseFormat.Type == "json_schema":
		if f.ResponseFormat.JSONSchema == nil || len(f.ResponseFormat.JSONSchema.Schema) == 0 {
			return nil, errors.New("response_format json_schema needs json_schema.schema")
		}
		raw = f.ResponseFormat.JSONSchema.Schema
	default:
		return nil, fmt.Errorf("response_format type %q is not one of text, json_object or json_schema", f.ResponseFormat.Type)
	}
	var schema map[string]any
	if err := json.Unmarshal(raw, &schema); err != nil {
		return nil, fmt.Errorf("the JSON schema is not a JSON object: %v", err)
	}
	return &structuredSpec{schema: schema}, nil
}

// structuredText is the content of a structured answer to prompt; invalid
// breaks it.
func (s *Sim) structuredText(spec *structuredSpec, prompt []int, invalid bool) string {
	rng := rand.New(rand.NewPCG(blockHash(s.cfg.Seed, prompt), 0x150))
	g := schemaGen{root: spec.schema, rng: rng}
	var v any = map[string]any{"answer": g.word()}
	if spec.schema != nil {
		v = g.value(spec.schema, 0)
	}
	b, _ := json.Marshal(v)
	if !invalid {
		return string(b)
	}
	if typ := schemaType(spec.schema); typ != "" && rng.IntN(2) == 0 {
		// JSON of the wrong type for the schema's root.
		if typ == "string" {
			return `{"unexpected": true}`
		}
		return strconv.Quote("not " + typ)
	}
	return string(b[:len(b)/2]) // not JSON
}

// invalidJSON draws whether request r's structured answer breaks its
// schema; Match narrows it as it narrows the other rates.
func (s *faultSet) invalidJSON(r *http.Request) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if matched, _ := r.Context().Value(faultMatchKey{}).(bool); s.cur.Match != "" && !matched {
		return false
	}
	return s.cur.InvalidJSONRate > 0 && s.rng.Float64() < s.cur.InvalidJSONRate
}

// structuredCall reads what a generation request asked for into c, or
// answers its 400 and returns false.
func (s *Sim) structuredCall(w http.ResponseWriter, r *http.Request, c *genCall, f structuredFields) bool {
	spec, err := f.spec()
	if err != nil {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", err.Error(), "response_format")
		return false
	}
	if spec != nil && c.stream {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "the simulator honours structured outputs only without stream", "stream")
		return false
	}
	c.structured = spec
	c.invalidJSON = spec != nil && s.faults.invalidJSON(r)
	return true
}

// schemaGen builds a value that conforms to a JSON Schema: the keywords a
// structured-output schema uses (type, properties, required, items,
// prefixItems, enum, const, minimum/maximum, minLength/maxLength,
// minItems/maxItems, anyOf/oneOf/allOf, $ref into $defs, a few formats).
type schemaGen struct {
	root map[string]any
	rng  *rand.Rand
}

const maxSchemaDepth = 16

var simWords = []string{"alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"}

func (g *schemaGen) word() string { return simWords[g.rng.IntN(len(simWords))] }

func (g *schemaGen) value(s map[string]any, depth int) any {
	if depth > maxSchemaDepth {
		return nil
	}
	if ref, ok := s["$ref"].(string); ok {
		if t := g.deref(ref); t != nil {
			return g.value(t, depth+1)
		}
	}
	if c, ok := s["const"]; ok {
		return c
	}
	if e, ok := s["enum"].([]any); ok && len(e) > 0 {
		return e[g.rng.IntN(len(e))]
	}
	for _, k := range []string{"anyOf", "oneOf", "allOf"} {
		if alts, ok := s[k].([]any); ok && len(alts) > 0 {
			if a, ok := alts[0].(map[string]any); ok {
				if k == "allOf" {
					return g.value(mergeSchemas(s, alts), depth+1)
				}
				return g.value(a, depth+1)
			}
		}
	}
	switch schemaType(s) {
	case "object":
		out := map[string]any{}
		props, _ := s["properties"].(map[string]any)
		keys := make([]string, 0, len(props))
		for k := range props {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			if p, ok := props[k].(map[string]any); ok {
				out[k] = g.value(p, depth+1)
			} else {
				out[k] = g.word()
			}
		}
		if req, ok := s["required"].([]any); ok {
			for _, r := range req {
				if k, ok := r.(string); ok {
					if _, have := out[k]; !have {
						out[k] = g.word()
					}
				}
			}
		}
		return out
	case "array":
		lo, hi := intKeyword(s, "minItems", 0), intKeyword(s, "maxItems", -1)
		n := max(lo, 1+g.rng.IntN(3))
		if hi >= 0 {
			n = min(n, hi)
		}
		out := make([]any, 0, n)
		prefix, _ := s["prefixItems"].([]any)
		items, _ := s["items"].(map[string]any)
		for i := range n {
			switch {
			case i < len(prefix):
				p, _ := prefix[i].(map[string]any)
				out = append(out, g.value(p, depth+1))
			case items != nil:
				out = append(out, g.value(items, depth+1))
			default:
				out = append(out, g.word())
			}
		}
		return out
	case "integer":
		lo, hi := numRange(s, 0, 1000)
		lo, hi = math.Ceil(lo), math.Floor(hi)
		if hi < lo {
			return int64(lo)
		}
		return int64(lo) + g.rng.Int64N(int64(hi-lo)+1)
	case "number":
		lo, hi := numRange(s, 0, 1000)
		x := lo + g.rng.Float64()*(hi-lo)
		x = math.Round(x*100) / 100
		return min(max(x, lo), hi)
	case "boolean":
		return g.rng.IntN(2) == 0
	case "null":
		return nil
	}
	return g.str(s)
}

func (g *schemaGen) str(s map[string]any) string {
	switch s["format"] {
	case "date":
		return fmt.Sprintf("2026-%02d-%02d", 1+g.rng.IntN(12), 1+g.rng.IntN(28))
	case "date-time":
		return fmt.Sprintf("2026-%02d-%02dT%02d:00:00Z", 1+g.rng.IntN(12), 1+g.rng.IntN(28), g.rng.IntN(24))
	case "email":
		return g.word() + "@example.com"
	case "uuid":
		return fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", g.rng.Uint32(), g.rng.IntN(1<<16), g.rng.IntN(1<<12), g.rng.IntN(1<<12), g.rng.Int64N(1<<48))
	}
	w := g.word()
	lo, hi := intKeyword(s, "minLength", 0), intKeyword(s, "maxLength", -1)
	for len(w) < lo {
		w += " " + g.word()
	}
	if hi >= 0 && len(w) > hi {
		w = w[:hi]
	}
	return w
}

// deref resolves a local reference (#/$defs/x, #/definitions/x, #).
func (g *schemaGen) deref(ref string) map[string]any {
	if ref == "#" {
		return g.root
	}
	if !strings.HasPrefix(ref, "#/") {
		return nil
	}
	var cur any = g.root
	for _, seg := range strings.Split(ref[2:], "/") {
		m, ok := cur.(map[string]any)
		if !ok {
			return nil
		}
		cur = m[strings.ReplaceAll(strings.ReplaceAll(seg, "~1", "/"), "~0", "~")]
	}
	m, _ := cur.(map[string]any)
	return m
}

// mergeSchemas folds allOf's members into one schema (properties and
// required unioned, the rest the last one's).
func mergeSchemas(s map[string]any, alts []any) map[string]any {
	out := map[string]any{}
	props := map[string]any{}
	var req []any
	for _, a := range append([]any{s}, alts...) {
		m, ok := a.(map[string]any)
		if !ok {
			continue
		}
		for k, v := range m {
			switch k {
			case "allOf":
			case "properties":
				if p, ok := v.(map[string]any); ok {
					for pk, pv := range p {
						props[pk] = pv
					}
				}
			case "required":
				if r, ok := v.([]any); ok {
					req = append(req, r...)
				}
			default:
				out[k] = v
			}
		}
	}
	if len(props) > 0 {
		out["properties"] = props
		if out["type"] == nil {
			out["type"] = "object"
		}
	}
	if len(req) > 0 {
		out["required"] = req
	}
	return out
}

// schemaType is a schema's type: its type keyword (the first non-null of
// a list), or what its keywords imply; "" when nothing says.
func schemaType(s map[string]any) string {
	switch t := s["type"].(type) {
	case string:
		return t
	case []any:
		for _, x := range t {
			if x, ok := x.(string); ok && x != "null" {
				return x
			}
		}
		if len(t) > 0 {
			return "null"
		}
	}
	switch {
	case s["properties"] != nil || s["required"] != nil:
		return "object"
	case s["items"] != nil || s["prefixItems"] != nil:
		return "array"
	}
	return ""
}

func intKeyword(s map[string]any, k string, def int) int {
	if f, ok := s[k].(float64); ok && f >= 0 && f < 1<<20 {
		return int(f)
	}
	return def
}

// numRange is the range a number keyword set allows, defaulting to
// [lo, hi] around what is given.
func numRange(s map[string]any, lo, hi float64) (float64, float64) {
	hasLo, hasHi := false, false
	if v, ok := s["minimum"].(float64); ok {
		lo, hasLo = v, true
	}
	if v, ok := s["exclusiveMinimum"].(float64); ok {
		lo, hasLo = v+1, true
	}
	if v, ok := s["maximum"].(float64); ok {
		hi, hasHi = v, true
	}
	if v, ok := s["exclusiveMaximum"].(float64); ok {
		hi, hasHi = v-1, true
	}
	switch {
	case hasLo && !hasHi:
		hi = lo + 1000
	case hasHi && !hasLo:
		lo = hi - 1000
	}
	return lo, hi
}

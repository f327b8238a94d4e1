// Package validate checks a model's answer against a validation policy: a
// named, versioned list of rules, each of which reports what it found
// wrong as machine-readable reasons that carry a JSON pointer into the
// answer. It is pure (no I/O, no clock): the runner's validation stage and
// the review API's re-validation of a corrected result call the same
// Check, so a result is judged by one rule wherever it is judged.
//
// Model output is data here: nothing in an answer can change which rules
// run or what they allow. Schemas are compiled with a loader that refuses
// every URL, so a "$ref" can reach nothing but the schema itself.
package validate

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/big"
	"slices"
	"strconv"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// The rules.
const (
	RuleJSON     = "json"     // the answer parses as JSON
	RuleSchema   = "schema"   // it conforms to a JSON Schema
	RuleEnum     = "enum"     // the value at a pointer is one of a list
	RuleSum      = "sum"      // numbers at a wildcard pointer add up to another
	RuleEvidence = "evidence" // strings at a pointer occur in the source text
)

// Reason codes.
const (
	CodeInvalidJSON     = "invalid_json"     // the answer is not JSON
	CodeSchemaViolation = "schema_violation" // a schema keyword failed at the pointer
	CodeNoSchema        = "no_schema"        // a schema rule without a schema, and the request gave none
	CodeMissing         = "missing"          // nothing at the pointer
	CodeNotAllowed      = "not_allowed"      // the value is not in the enum
	CodeNotANumber      = "not_a_number"     // a sum operand is not a number
	CodeSumMismatch     = "sum_mismatch"     // the items do not add up to the total
	CodeNotAString      = "not_a_string"     // an evidence value is not a string
	CodeNotInSource     = "not_in_source"    // an evidence string is not in the source
)

// Reason is one thing a rule found wrong, at Pointer (RFC 6901) in the
// answer ("" is the whole answer).
type Reason struct {
	Rule    string `json:"rule"`
	Code    string `json:"code"`
	Pointer string `json:"pointer"`
	Message string `json:"message"`
}

// Rule is one rule of a policy document; which fields apply depends on
// Rule.
type Rule struct {
	Rule string `json:"rule"`
	// Schema is the schema rule's JSON Schema; without it, the request's
	// own response_format json_schema (or guided_json) is used.
	Schema json.RawMessage `json:"schema,omitempty"`
	// Pointer names the value of an enum or evidence rule; "*" as a
	// segment matches every element of an array (or member of an object).
	Pointer string `json:"pointer,omitempty"`
	// Values are the enum rule's permitted values.
	Values []json.RawMessage `json:"values,omitempty"`
	// Items and Total are the sum rule's pointers; Tolerance is how far
	// the sum may be from the total.
	Items     string  `json:"items,omitempty"`
	Total     string  `json:"total,omitempty"`
	Tolerance float64 `json:"tolerance,omitempty"`
}

// Document is a policy as stored and as POSTed.
type Document struct {
	Name  string `json:"name"`
	Rules []Rule `json:"rules"`
}

// Policy is a compiled policy document.
type Policy struct {
	doc   Document
	rules []compiled
}

type compiled struct {
	Rule
	schema *jsonschema.Schema // the schema rule's own, compiled
	values []any              // the enum values, decoded
	tol    *big.Rat
}

// MaxRules bounds a policy's length.
const MaxRules = 64

// Parse reads and compiles a policy document: every rule known, every
// pointer well formed, every schema compiles, every enum non-empty. Its
// error says what is wrong, for the API's 400.
func Parse(doc []byte) (*Policy, error) {
	var d Document
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&d); err != nil {
		return nil, fmt.Errorf("the policy is not a valid policy document: %v", err)
	}
	if dec.More() {
		return nil, errors.New("the policy has trailing data after its JSON object")
	}
	return compile(d)
}

func compile(d Document) (*Policy, error) {
	if len(d.Rules) == 0 {
		return nil, errors.New("rules must list at least one rule")
	}
	if len(d.Rules) > MaxRules {
		return nil, fmt.Errorf("a policy has at most %d rules", MaxRules)
	}
	p := &Policy{doc: d}
	for i, r := range d.Rules {
		c := compiled{Rule: r}
		at := fmt.Sprintf("rules[%d] (%s)", i, r.Rule)
		switch r.Rule {
		case RuleJSON:
		case RuleSchema:
			if len(r.Schema) > 0 {
				s, err := compileSchema(r.Schema)
				if err != nil {
					return nil, fmt.Errorf("%s: %v", at, err)
				}
				c.schema = s
			}
		case RuleEnum:
			if err := checkPointer(r.Pointer); err != nil {
				return nil, fmt.Errorf("%s: pointer: %v", at, err)
			}
			if len(r.Values) == 0 {
				return nil, fmt.Errorf("%s: values must list at least one value", at)
			}
			for _, v := range r.Values {
				x, err := decode(v)
				if err != nil {
					return nil, fmt.Errorf("%s: values: %v", at, err)
				}
				c.values = append(c.values, x)
			}
		case RuleSum:
			if err := checkPointer(r.Items); err != nil {
				return nil, fmt.Errorf("%s: items: %v", at, err)
			}
			if err := checkPointer(r.Total); err != nil {
				return nil, fmt.Errorf("%s: total: %v", at, err)
			}
			if strings.Contains(r.Total, "*") {
				return nil, fmt.Errorf("%s: total must name one value, without a wildcard", at)
			}
			if !(r.Tolerance >= 0) {
				return nil, fmt.Errorf("%s: tolerance must not be negative", at)
			}
			c.tol = new(big.Rat)
			c.tol.SetFloat64(r.Tolerance)
		case RuleEvidence:
			if err := checkPointer(r.Pointer); err != nil {
				return nil, fmt.Errorf("%s: pointer: %v", at, err)
			}
		default:
			return nil, fmt.Errorf("rules[%d]: unknown rule %q (json, schema, enum, sum or evidence)", i, r.Rule)
		}
		p.rules = append(p.rules, c)
	}
	return p, nil
}

// Document returns the policy as parsed.
func (p *Policy) Document() Document { return p.doc }

// refuseLoader loads no URL: a schema is self-contained.
type refuseLoader struct{}

func (refuseLoader) Load(url string) (any, error) {
	return nil, fmt.Errorf("schemas may not load %s: a policy's schema must be self-contained", url)
}

// compileSchema compiles one JSON Schema document.
func compileSchema(raw json.RawMessage) (*jsonschema.Schema, error) {
	doc, err := decode(raw)
	if err != nil {
		return nil, fmt.Errorf("schema: %v", err)
	}
	c := jsonschema.NewCompiler()
	c.UseLoader(refuseLoader{})
	const url = "urn:kvgate:schema"
	if err := c.AddResource(url, doc); err != nil {
		return nil, fmt.Errorf("schema: %v", err)
	}
	s, err := c.Compile(url)
	if err != nil {
		return nil, fmt.Errorf("schema does not compile: %v", err)
	}
	return s, nil
}

// CompileSchema checks a request's own schema (response_format's
// json_schema.schema), as a submission does before the job is accepted.
func CompileSchema(raw json.RawMessage) error {
	_, err := compileSchema(raw)
	return err
}

// decode reads JSON with numbers kept exact (json.Number).
func decode(raw []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err == nil {
		return nil, errors.New("trailing data after the JSON value")
	}
	return v, nil
}

// Input is what a check judges.
type Input struct {
	// Answer is the model's answer: a chat message's content or a
	// completion's text (see Answer).
	Answer string
	// RequestSchema is the request's own JSON Schema, if it asked for
	// one; a schema rule without a schema of its own uses it.
	RequestSchema json.RawMessage
	// Source is the text the answer's evidence must occur in.
	Source string
}

// Check runs every rule of p on in and returns the reasons the answer
// fails, in rule order; none means it passes. An answer that is not JSON
// fails with one invalid_json reason whatever the rules, since no other
// rule can judge it.
func (p *Policy) Check(in Input) []Reason {
	doc, err := decode([]byte(in.Answer))
	if err != nil {
		return []Reason{{Rule: RuleJSON, Code: CodeInvalidJSON, Pointer: "", Message: "the answer is not JSON: " + err.Error()}}
	}
	var out []Reason
	for _, r := range p.rules {
		out = append(out, r.check(doc, in)...)
	}
	return out
}

func (r compiled) check(doc any, in Input) []Reason {
	switch r.Rule.Rule {
	case RuleSchema:
		return r.checkSchema(doc, in)
	case RuleEnum:
		return r.checkEnum(doc)
	case RuleSum:
		return r.checkSum(doc)
	case RuleEvidence:
		return r.checkEvidence(doc, in)
	}
	return nil // json: Check parsed it
}

func (r compiled) checkSchema(doc any, in Input) []Reason {
	s := r.schema
	if s == nil {
		if len(in.RequestSchema) == 0 {
			return []Reason{{Rule: RuleSchema, Code: CodeNoSchema, Message: "the policy's schema rule has no schema and the request asked for none"}}
		}
		var err error
		if s, err = compileSchema(in.RequestSchema); err != nil {
			return []Reason{{Rule: RuleSchema, Code: CodeNoSchema, Message: "the request's schema does not compile: " + err.Error()}}
		}
	}
	err := s.Validate(doc)
	if err == nil {
		return nil
	}
	var ve *jsonschema.ValidationError
	if !errors.As(err, &ve) {
		return []Reason{{Rule: RuleSchema, Code: CodeSchemaViolation, Message: err.Error()}}
	}
	var out []Reason
	for _, u := range ve.BasicOutput().Errors {
		if u.Error == nil {
			continue
		}
		msg := u.Error.String()
		if strings.HasPrefix(msg, "validation failed") {
			continue // a summary of its causes, listed on their own
		}
		out = append(out, Reason{Rule: RuleSchema, Code: CodeSchemaViolation, Pointer: u.InstanceLocation,
			Message: u.KeywordLocation + ": " + msg})
	}
	if len(out) == 0 {
		out = append(out, Reason{Rule: RuleSchema, Code: CodeSchemaViolation, Message: ve.Error()})
	}
	return out
}

func (r compiled) checkEnum(doc any) []Reason {
	ms := resolve(doc, r.Pointer)
	if len(ms) == 0 {
		return []Reason{{Rule: RuleEnum, Code: CodeMissing, Pointer: r.Pointer, Message: "no value at " + r.Pointer}}
	}
	var out []Reason
	for _, m := range ms {
		if !slices.ContainsFunc(r.values, func(v any) bool { return equal(v, m.value) }) {
			b, _ := json.Marshal(m.value)
			out = append(out, Reason{Rule: RuleEnum, Code: CodeNotAllowed, Pointer: m.pointer,
				Message: fmt.Sprintf("%s is not one of the permitted values", b)})
		}
	}
	return out
}

func (r compiled) checkSum(doc any) []Reason {
	totals := resolve(doc, r.Total)
	if len(totals) == 0 {
		return []Reason{{Rule: RuleSum, Code: CodeMissing, Pointer: r.Total, Message: "no total at " + r.Total}}
	}
	total, ok := number(totals[0].value)
	if !ok {
		return []Reason{{Rule: RuleSum, Code: CodeNotANumber, Pointer: r.Total, Message: "the total is not a number"}}
	}
	var out []Reason
	sum := new(big.Rat)
	for _, m := range resolve(doc, r.Items) {
		x, ok := number(m.value)
		if !ok {
			out = append(out, Reason{Rule: RuleSum, Code: CodeNotANumber, Pointer: m.pointer, Message: "an item to add up is not a number"})
			continue
		}
		sum.Add(sum, x)
	}
	if len(out) > 0 {
		return out
	}
	diff := new(big.Rat).Sub(sum, total)
	if diff.Abs(diff).Cmp(r.tol) > 0 {
		return []Reason{{Rule: RuleSum, Code: CodeSumMismatch, Pointer: r.Total,
			Message: fmt.Sprintf("the items at %s add up to %s, not the total %s (tolerance %g)", r.Items,
				sum.FloatString(6), total.FloatString(6), r.Tolerance)}}
	}
	return nil
}

func (r compiled) checkEvidence(doc any, in Input) []Reason {
	ms := resolve(doc, r.Pointer)
	if len(ms) == 0 {
		return []Reason{{Rule: RuleEvidence, Code: CodeMissing, Pointer: r.Pointer, Message: "no value at " + r.Pointer}}
	}
	source := normalize(in.Source)
	var out []Reason
	for _, m := range ms {
		s, ok := m.value.(string)
		switch {
		case !ok:
			out = append(out, Reason{Rule: RuleEvidence, Code: CodeNotAString, Pointer: m.pointer, Message: "the evidence is not a string"})
		case strings.TrimSpace(s) == "" || !strings.Contains(source, normalize(s)):
			out = append(out, Reason{Rule: RuleEvidence, Code: CodeNotInSource, Pointer: m.pointer,
				Message: "the value does not occur in the job's source text"})
		}
	}
	return out
}

// normalize collapses runs of white space, so that a quote that only
// wraps differently still matches.
func normalize(s string) string { return strings.Join(strings.Fields(s), " ") }

// number reads a JSON number exactly.
func number(v any) (*big.Rat, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return nil, false
	}
	r, ok := new(big.Rat).SetString(string(n))
	return r, ok
}

// equal compares decoded JSON values; numbers by value (1 equals 1.0).
func equal(a, b any) bool {
	if x, ok := number(a); ok {
		y, ok := number(b)
		return ok && x.Cmp(y) == 0
	}
	switch a := a.(type) {
	case string, bool, nil:
		return a == b
	case []any:
		b, ok := b.([]any)
		return ok && slices.EqualFunc(a, b, equal)
	case map[string]any:
		b, ok := b.(map[string]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for k, v := range a {
			w, ok := b[k]
			if !ok || !equal(v, w) {
				return false
			}
		}
		return true
	}
	return false
}

// checkPointer reports whether p is an RFC 6901 pointer (with "*"
// segments allowed).
func checkPointer(p string) error {
	if p == "" {
		return nil
	}
	if !strings.HasPrefix(p, "/") {
		return fmt.Errorf("%q is not a JSON pointer: it must be empty or start with /", p)
	}
	for _, seg := range strings.Split(p[1:], "/") {
		for i := 0; i < len(seg); i++ {
			if seg[i] == '~' && (i+1 == len(seg) || (seg[i+1] != '0' && seg[i+1] != '1')) {
				return fmt.Errorf("%q is not a JSON pointer: ~ must be followed by 0 or 1", p)
			}
		}
	}
	return nil
}

type match struct {
	pointer string // the concrete pointer of the value
	value   any
}

// resolve returns the values at pointer p in doc, expanding "*" segments
// over arrays (and objects, in key order), each with its own pointer.
func resolve(doc any, p string) []match {
	if p == "" {
		return []match{{"", doc}}
	}
	segs := strings.Split(p[1:], "/")
	cur := []match{{"", doc}}
	for _, raw := range segs {
		seg := strings.ReplaceAll(strings.ReplaceAll(raw, "~1", "/"), "~0", "~")
		var next []match
		for _, m := range cur {
			switch v := m.value.(type) {
			case []any:
				if raw == "*" {
					for i, e := range v {
						next = append(next, match{m.pointer + "/" + strconv.Itoa(i), e})
					}
					continue
				}
				i, err := strconv.Atoi(seg)
				if err == nil && i >= 0 && i < len(v) && strconv.Itoa(i) == seg {
					next = append(next, match{m.pointer + "/" + seg, v[i]})
				}
			case map[string]any:
				if raw == "*" {
					for _, k := range slices.Sorted(maps.Keys(v)) {
						next = append(next, match{m.pointer + "/" + escape(k), v[k]})
					}
					continue
				}
				if e, ok := v[seg]; ok {
					next = append(next, match{m.pointer + "/" + raw, e})
				}
			}
		}
		cur = next
	}
	return cur
}

func escape(k string) string { return strings.ReplaceAll(strings.ReplaceAll(k, "~", "~0"), "/", "~1") }

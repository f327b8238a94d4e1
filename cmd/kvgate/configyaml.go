package main

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

var durationType = reflect.TypeOf(time.Duration(0))

// yamlName is a struct field's YAML key ("" for none), and whether it is
// inlined.
func yamlName(f reflect.StructField) (name string, inline bool) {
	tag, ok := f.Tag.Lookup("yaml")
	if !ok {
		if !f.IsExported() {
			return "", false
		}
		return strings.ToLower(f.Name), false // yaml.v3's default
	}
	name, opts, _ := strings.Cut(tag, ",")
	if name == "-" {
		return "", false
	}
	return name, strings.Contains(","+opts+",", ",inline,")
}

// fieldByPath finds the field a YAML path names ("nats.tls.ca_file"),
// allocating pointers on the way.
func fieldByPath(v reflect.Value, path string) (reflect.Value, reflect.StructField, error) {
	var sf reflect.StructField
	for _, key := range strings.Split(path, ".") {
		for v.Kind() == reflect.Pointer {
			if v.IsNil() {
				v.Set(reflect.New(v.Type().Elem()))
			}
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct {
			return reflect.Value{}, sf, fmt.Errorf("%s: %s is not a mapping", path, key)
		}
		found := false
		for i := range v.NumField() {
			if n, _ := yamlName(v.Type().Field(i)); n == key {
				v, sf, found = v.Field(i), v.Type().Field(i), true
				break
			}
		}
		if !found {
			return reflect.Value{}, sf, fmt.Errorf("%s: no key %s", path, key)
		}
	}
	return v, sf, nil
}

// applySetting sets a setting's field from an environment variable's or
// a flag's text.
func applySetting(cfg *config, root reflect.Value, s setting, vals []string) error {
	if s.parse != nil {
		return s.parse(cfg, vals)
	}
	v, _, err := fieldByPath(root, s.path)
	if err != nil {
		return err
	}
	return setScalar(v, vals[len(vals)-1])
}

// setScalar parses text into v by v's type; the error says the expected
// form, never a Go type.
func setScalar(v reflect.Value, text string) error {
	if v.Kind() == reflect.Pointer {
		n := reflect.New(v.Type().Elem())
		if err := setScalar(n.Elem(), text); err != nil {
			return err
		}
		v.Set(n)
		return nil
	}
	if v.Type() == durationType {
		d, err := parseDuration(text)
		if err != nil {
			return err
		}
		v.SetInt(int64(d))
		return nil
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(text)
	case reflect.Bool:
		b, err := strconv.ParseBool(text)
		if err != nil {
			return fmt.Errorf("%q: write true or false", text)
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		n, err := strconv.ParseInt(text, 10, v.Type().Bits())
		if err != nil {
			return fmt.Errorf("%q: write a whole number", text)
		}
		v.SetInt(n)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		n, err := strconv.ParseUint(text, 10, v.Type().Bits())
		if err != nil {
			return fmt.Errorf("%q: write a whole number, 0 or more", text)
		}
		v.SetUint(n)
	case reflect.Float32, reflect.Float64:
		f, err := strconv.ParseFloat(text, 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%q: write a number such as 0.95", text)
		}
		v.SetFloat(f)
	default:
		return fmt.Errorf("%q: set this key in the YAML file", text)
	}
	return nil
}

// parseDuration reads a Go duration; a bare number gets the hint to add
// a unit.
func parseDuration(text string) (time.Duration, error) {
	d, err := time.ParseDuration(strings.TrimSpace(text))
	if err == nil {
		return d, nil
	}
	if _, nerr := strconv.ParseFloat(strings.TrimSpace(text), 64); nerr == nil {
		return 0, fmt.Errorf("%s is a number without a unit: write %ss (or %sms, %sm: units ns, us, ms, s, m, h)", text, text, text, text)
	}
	return 0, fmt.Errorf("%q is not a duration: write one such as 30s, 1m30s or 250ms", text)
}

// loadYAMLFile reads the file into cfg strictly: one document; every key
// known; every value of the expected form. Errors name the file, the line
// and the key's YAML path, and say what to write.
func loadYAMLFile(file string, cfg *config) error {
	b, err := os.ReadFile(file)
	if err != nil {
		return fmt.Errorf("read config: %w", err)
	}
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) { // an empty file
			return nil
		}
		return fmt.Errorf("config %s: %s", file, strings.TrimPrefix(err.Error(), "yaml: "))
	}
	// Decode reads one document; what a second one sets (api_keys after
	// a "---") would be dropped without a word.
	for {
		var more yaml.Node
		err := dec.Decode(&more)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("config %s: %s", file, strings.TrimPrefix(err.Error(), "yaml: "))
		}
		if len(more.Content) > 0 && more.Content[0].Tag != "!!null" {
			return fmt.Errorf("config %s holds more than one YAML document; kvgate reads one", file)
		}
	}
	if len(doc.Content) == 0 {
		return nil
	}
	if err := checkNode(doc.Content[0], reflect.TypeOf(cfg).Elem(), ""); err != nil {
		return fmt.Errorf("config %s %w", file, err)
	}
	// The tree is checked: the decoder's own errors (which name Go types)
	// are not expected from here on.
	if err := decodeStrict(doc.Content[0], cfg); err != nil {
		return fmt.Errorf("config %s: %s", file, strings.TrimPrefix(err.Error(), "yaml: "))
	}
	return nil
}

func decodeStrict(n *yaml.Node, cfg *config) error {
	out, err := yaml.Marshal(n)
	if err != nil {
		return err
	}
	dec := yaml.NewDecoder(strings.NewReader(string(out)))
	dec.KnownFields(true)
	return dec.Decode(cfg)
}

// nodeError is a problem at a node: "line N: PATH: what".
func nodeError(n *yaml.Node, path, format string, args ...any) error {
	if path == "" {
		path = "(top level)"
	}
	return fmt.Errorf("line %d: %s: %s", n.Line, path, fmt.Sprintf(format, args...))
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

var yamlUnmarshaler = reflect.TypeFor[yaml.Unmarshaler]()

// checkNode checks a YAML node against the type it will be decoded into.
func checkNode(n *yaml.Node, t reflect.Type, path string) error {
	if n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil // left as it was
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if reflect.PointerTo(t).Implements(yamlUnmarshaler) {
		return nil // the type reads its own forms, and says what it wants
	}
	if t == durationType {
		if n.Kind != yaml.ScalarNode {
			return nodeError(n, path, "write a duration such as 30s")
		}
		if _, err := parseDuration(n.Value); err != nil {
			return nodeError(n, path, "%v", err)
		}
		return nil
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return nodeError(n, path, "write a mapping of keys (%s)", strings.Join(keysOf(t), ", "))
		}
		fields := map[string]reflect.Type{}
		collectFields(t, fields)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			ft, ok := fields[k.Value]
			if !ok {
				hint := ""
				if near := nearest(k.Value, keysOf(t)); near != "" {
					hint = fmt.Sprintf(" (did you mean %s?)", near)
				}
				return nodeError(k, join(path, k.Value), "unknown key%s; the keys here are %s", hint, strings.Join(keysOf(t), ", "))
			}
			if err := checkNode(v, ft, join(path, k.Value)); err != nil {
				return err
			}
		}
		return nil
	case reflect.Slice, reflect.Array:
		if n.Kind != yaml.SequenceNode {
			return nodeError(n, path, "write a list (- item per line, or [a, b])")
		}
		for i, item := range n.Content {
			if err := checkNode(item, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		return nil
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			return nodeError(n, path, "write a mapping (key: value)")
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			if err := checkNode(n.Content[i+1], t.Elem(), join(path, n.Content[i].Value)); err != nil {
				return err
			}
		}
		return nil
	case reflect.Interface:
		return nil
	}
	if n.Kind != yaml.ScalarNode {
		return nodeError(n, path, "write %s, not a %s", scalarForm(t), map[yaml.Kind]string{yaml.MappingNode: "mapping", yaml.SequenceNode: "list"}[n.Kind])
	}
	probe := reflect.New(t)
	if err := n.Decode(probe.Interface()); err != nil {
		return nodeError(n, path, "%q: write %s", n.Value, scalarForm(t))
	}
	return nil
}

// scalarForm is the expected form of a scalar of type t, in words.
func scalarForm(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "a whole number"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a whole number, 0 or more"
	case reflect.Float32, reflect.Float64:
		return "a number such as 0.95"
	case reflect.String:
		return "text"
	}
	return "a value"
}

// collectFields maps a struct's YAML keys, inlined structs' included.
func collectFields(t reflect.Type, into map[string]reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		name, inline := yamlName(f)
		switch {
		case inline:
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				collectFields(ft, into)
			}
		case name != "":
			into[name] = f.Type
		}
	}
}

func keysOf(t reflect.Type) []string {
	m := map[string]reflect.Type{}
	collectFields(t, m)
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// nearest is the known key closest to key: within two edits, three for
// a key of six letters or more.
func nearest(key string, keys []string) string {
	best, bestD := "", 3
	if len(key) >= 6 {
		bestD = 4
	}
	for _, k := range keys {
		if d := editDistance(key, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// defaultText renders a field's value in the default configuration, ""
// when it is zero.
func defaultText(v reflect.Value) string {
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return ""
		}
		v = v.Elem()
	}
	if v.IsZero() {
		return ""
	}
	if v.Type() == durationType {
		d := time.Duration(v.Int()).String()
		for _, zero := range []string{"m0s", "h0m"} { // 1m0s reads 1m
			if strings.HasSuffix(d, zero) {
				d = strings.TrimSuffix(d, zero[1:])
			}
		}
		return d
	}
	switch v.Kind() {
	case reflect.String, reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Float32, reflect.Float64:
		return fmt.Sprint(v.Interface())
	}
	return ""
}

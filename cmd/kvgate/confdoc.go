package main

import (
	"bufio"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
)

// The configuration reference in docs/configuration.md is generated from
// the config struct (its YAML keys, types, defaults and comments) and the
// settings table (environment variables and flags), between these
// markers; the rest of the page is written by hand. TestConfigReference
// fails when the page is stale; `make docs` (or go generate ./cmd/kvgate)
// writes it.
const (
	refBegin = "<!-- BEGIN GENERATED: configuration reference (make docs; edit cmd/kvgate/config.go, not this table) -->"
	refEnd   = "<!-- END GENERATED: configuration reference -->"
)

// docRow is one key of the reference.
type docRow struct {
	path, env, flag, form, def, desc string
}

// configReference renders the reference from the source tree at root
// (the module's root, for the comments).
func configReference(root string) (string, error) {
	src, err := newSourceIndex(root)
	if err != nil {
		return "", err
	}
	var rows []docRow
	t := reflect.TypeOf(config{})
	walkConfig(src, t, src.structOf("main", "config", filepath.Join(root, "cmd", "kvgate")), reflect.ValueOf(defaultConfig()).Elem(), "", &rows)
	bySetting := map[string]setting{}
	for _, s := range settings {
		bySetting[s.path] = s
	}
	var sb strings.Builder
	sb.WriteString("| YAML key | environment | flag | form | default | what |\n|---|---|---|---|---|---|\n")
	for _, r := range rows {
		if s, ok := bySetting[r.path]; ok {
			if s.env != "" {
				r.env = "`" + s.env + "`"
			}
			if s.flag != "" {
				r.flag = "`--" + s.flag + "`"
			}
		}
		def := r.def
		if def != "" {
			def = "`" + def + "`"
		}
		fmt.Fprintf(&sb, "| `%s` | %s | %s | %s | %s | %s |\n", r.path, r.env, r.flag, r.form, def, cell(r.desc))
	}
	return sb.String(), nil
}

func cell(s string) string { return strings.ReplaceAll(s, "|", `\|`) }

// bracketDefault is the "[default]" convention of the code's comments.
var bracketDefault = regexp.MustCompile(`\s*\[([^\[\]]+)\]`)

// walkConfig adds a row per key of struct type t (whose source is st, nil
// when not found) under path, with the defaults found in def.
func walkConfig(src *sourceIndex, t reflect.Type, st *ast.StructType, def reflect.Value, path string, rows *[]docRow) {
	for i := range t.NumField() {
		f := t.Field(i)
		name, inline := yamlName(f)
		if name == "" && !inline {
			continue
		}
		var af *ast.Field
		if st != nil {
			for _, fl := range st.Fields.List {
				for _, n := range fl.Names {
					if n.Name == f.Name {
						af = fl
					}
				}
			}
		}
		var fdef reflect.Value
		if def.IsValid() {
			fdef = def.Field(i)
		}
		if inline {
			walkConfig(src, deref(f.Type), src.structFor(deref(f.Type), astType(af)), derefValue(fdef), path, rows)
			continue
		}
		key := join(path, name)
		desc := ""
		if af != nil {
			desc = strings.TrimSpace(strings.Join(strings.Fields(af.Doc.Text()+" "+af.Comment.Text()), " "))
		}
		r := docRow{path: key, desc: desc, form: formOf(f.Type)}
		if fdef.IsValid() {
			r.def = defaultText(fdef)
		}
		if m := bracketDefault.FindStringSubmatchIndex(desc); m != nil {
			if r.def == "" {
				r.def = desc[m[2]:m[3]]
			}
			r.desc = strings.TrimSpace(desc[:m[0]] + desc[m[1]:])
		}
		r.desc = withoutGoName(r.desc, f.Name)
		ft := deref(f.Type)
		switch {
		case ft.Kind() == reflect.Struct && ft != durationType:
			r.form = "section"
			*rows = append(*rows, r)
			walkConfig(src, ft, src.structFor(ft, astType(af)), derefValue(fdef), key, rows)
		case (ft.Kind() == reflect.Slice || ft.Kind() == reflect.Map) && deref(ft.Elem()).Kind() == reflect.Struct:
			*rows = append(*rows, r)
			sub := key + "[]"
			if ft.Kind() == reflect.Map {
				sub = key + ".NAME"
			}
			walkConfig(src, deref(ft.Elem()), src.structFor(deref(ft.Elem()), elemAST(astType(af))), reflect.Value{}, sub, rows)
		default:
			*rows = append(*rows, r)
		}
	}
}

func deref(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

func derefValue(v reflect.Value) reflect.Value {
	for v.IsValid() && v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return reflect.Value{}
		}
		v = v.Elem()
	}
	return v
}

func astType(f *ast.Field) ast.Expr {
	if f == nil {
		return nil
	}
	return f.Type
}

// elemAST is the element type of a slice, map or pointer expression.
func elemAST(e ast.Expr) ast.Expr {
	for {
		switch x := e.(type) {
		case *ast.StarExpr:
			e = x.X
		case *ast.ArrayType:
			return unstar(x.Elt)
		case *ast.MapType:
			return unstar(x.Value)
		default:
			return e
		}
	}
}

func unstar(e ast.Expr) ast.Expr {
	for {
		s, ok := e.(*ast.StarExpr)
		if !ok {
			return e
		}
		e = s.X
	}
}

// formOf says in words what a key takes.
func formOf(t reflect.Type) string {
	t = deref(t)
	if t == durationType {
		return "duration (`30s`, `5m`)"
	}
	switch t.Kind() {
	case reflect.Bool:
		return "true/false"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "whole number"
	case reflect.Float32, reflect.Float64:
		return "number"
	case reflect.String:
		return "text"
	case reflect.Slice, reflect.Array:
		if e := deref(t.Elem()); e.Kind() == reflect.Struct {
			return "list of mappings"
		}
		return "list of " + formOf(t.Elem())
	case reflect.Map:
		return "mapping of " + formOf(t.Elem())
	case reflect.Struct:
		return "section"
	}
	return "value"
}

// sourceIndex finds struct declarations in the module's source, for their
// field comments.
type sourceIndex struct {
	root, module string
	pkgs         map[string]map[string]*ast.StructType // dir -> type name -> struct
}

func newSourceIndex(root string) (*sourceIndex, error) {
	f, err := os.Open(filepath.Join(root, "go.mod"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	module := ""
	for sc.Scan() {
		if m, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "module "); ok {
			module = strings.TrimSpace(m)
			break
		}
	}
	if module == "" {
		return nil, fmt.Errorf("%s/go.mod names no module", root)
	}
	return &sourceIndex{root: root, module: module, pkgs: map[string]map[string]*ast.StructType{}}, nil
}

// structFor is the source of struct type t: expr itself when it is a
// struct literal type, else t's declaration (nil if not found).
func (s *sourceIndex) structFor(t reflect.Type, expr ast.Expr) *ast.StructType {
	if st, ok := unstar(expr).(*ast.StructType); ok {
		return st
	}
	if t.Name() == "" || !strings.HasPrefix(t.PkgPath(), s.module) && t.PkgPath() != "main" {
		return nil
	}
	dir := filepath.Join(s.root, strings.TrimPrefix(t.PkgPath(), s.module))
	if t.PkgPath() == "main" {
		dir = filepath.Join(s.root, "cmd", "kvgate")
	}
	return s.structOf(t.PkgPath(), t.Name(), dir)
}

func (s *sourceIndex) structOf(_, name, dir string) *ast.StructType {
	types, ok := s.pkgs[dir]
	if !ok {
		types = map[string]*ast.StructType{}
		s.pkgs[dir] = types
		entries, _ := os.ReadDir(dir)
		fset := token.NewFileSet()
		var names []string
		for _, e := range entries {
			if n := e.Name(); strings.HasSuffix(n, ".go") && !strings.HasSuffix(n, "_test.go") {
				names = append(names, n)
			}
		}
		sort.Strings(names)
		for _, n := range names {
			file, err := parser.ParseFile(fset, filepath.Join(dir, n), nil, parser.ParseComments)
			if err != nil {
				continue
			}
			ast.Inspect(file, func(node ast.Node) bool {
				if ts, ok := node.(*ast.TypeSpec); ok {
					if st, ok := ts.Type.(*ast.StructType); ok {
						types[ts.Name.Name] = st
					}
				}
				return true
			})
		}
	}
	return types[name]
}

// updateReference replaces the generated part of page with ref, adding
// the markers at the end when the page has none.
func updateReference(page, ref string) string {
	block := refBegin + "\n" + ref + refEnd
	i, j := strings.Index(page, refBegin), strings.Index(page, refEnd)
	if i < 0 || j < i {
		return strings.TrimRight(page, "\n") + "\n\n## Reference\n\n" + block + "\n"
	}
	return page[:i] + block + page[j+len(refEnd):]
}

// withoutGoName drops a Go doc comment's leading field name ("KVTarget is
// the share ..." reads "The share ...").
func withoutGoName(desc, name string) string {
	for _, verb := range []string{" is ", " are "} {
		if rest, ok := strings.CutPrefix(desc, name+verb); ok && rest != "" {
			return strings.ToUpper(rest[:1]) + rest[1:]
		}
	}
	if rest, ok := strings.CutPrefix(desc, name+": "); ok && rest != "" {
		return strings.ToUpper(rest[:1]) + rest[1:]
	}
	return desc
}

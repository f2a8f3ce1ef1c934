package config

import (
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"time"

	yaml "go.yaml.in/yaml/v3"
)

// yamlProblems checks a YAML document against the shape of v's type before it is decoded, and
// reports every problem at once in plain words, each with its path and line: unknown keys
// ("workers[0].rol (line 5): unknown key; known keys: url, role, …") and values of the wrong
// kind ("workers[0].dp_size (line 9): want a whole number, got \"two\""). The decoder's own
// messages name Go types and stop at the first problem.
//
// It also spells durations for the decoder: a duration ("30s") becomes its nanoseconds, and
// smg's integer alias of a duration key (request_timeout_secs: 60) becomes the key itself. The
// document returned is what to decode.
func yamlProblems(data []byte, v any) ([]byte, []string) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, []string{"not valid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")}
	}
	if len(doc.Content) == 0 {
		return data, nil
	}
	var out []string
	checkNode(doc.Content[0], reflect.TypeOf(v).Elem(), "", &out)
	if len(out) > 0 {
		return nil, out
	}
	norm, err := yaml.Marshal(&doc)
	if err != nil {
		return nil, []string{err.Error()}
	}
	return norm, nil
}

// durationAlias turns k: n, the integer alias of a duration key of t (its field's unit tag),
// into the duration key with the duration in nanoseconds; it reports false when k is none.
func durationAlias(t reflect.Type, fields map[string]reflect.StructField, k, val *yaml.Node, path string, out *[]string) bool {
	for name, f := range fields {
		unit := f.Tag.Get("unit")
		if unit == "" || k.Value != name+"_"+unit {
			continue
		}
		n, err := strconv.ParseInt(val.Value, 10, 64)
		per := int64(unitOf(unit))
		if val.Kind != yaml.ScalarNode || err != nil || n > math.MaxInt64/per || n < math.MinInt64/per {
			*out = append(*out, fmt.Sprintf("%s (line %d): want a whole number (of %s), got %s", where(join(path, k.Value)), val.Line, unit, describe(val, join(path, k.Value))))
			return true
		}
		k.Value = name
		val.Value, val.Tag, val.Style = strconv.FormatInt(n*per, 10), "!!int", 0
		return true
	}
	return false
}

func checkNode(n *yaml.Node, t reflect.Type, path string, out *[]string) {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return // null leaves the default
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	bad := func(want string) {
		*out = append(*out, fmt.Sprintf("%s (line %d): want %s, got %s", where(path), n.Line, want, describe(n, path)))
	}
	if t == durationType {
		d, err := time.ParseDuration(n.Value)
		if n.Kind != yaml.ScalarNode || err != nil {
			bad("a duration (like 30s, 500ms, 2m)")
			return
		}
		n.Value, n.Tag, n.Style = strconv.FormatInt(int64(d), 10), "!!int", 0
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			bad("a mapping of keys to values")
			return
		}
		fields := jsonFields(t)
		seen := map[string]bool{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, val := n.Content[i], n.Content[i+1]
			alias := k.Value
			if durationAlias(t, fields, k, val, path, out) {
				if seen[k.Value] {
					*out = append(*out, fmt.Sprintf("%s (line %d): %s names the same setting again", where(join(path, alias)), k.Line, k.Value))
				}
				seen[k.Value] = true
				continue
			}
			if seen[k.Value] {
				*out = append(*out, fmt.Sprintf("%s (line %d): the setting is named twice", where(join(path, k.Value)), k.Line))
			}
			seen[k.Value] = true
			f, ok := fields[k.Value]
			if !ok {
				*out = append(*out, fmt.Sprintf("%s (line %d): unknown key%s; known keys: %s", where(join(path, k.Value)), k.Line, didYouMean(nearest(k.Value, fields)), knownKeys(t)))
				continue
			}
			checkNode(val, f.Type, join(path, k.Value), out)
		}
	case reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			bad("a list")
			return
		}
		for i, c := range n.Content {
			checkNode(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i), out)
		}
	case reflect.Map:
		if n.Kind != yaml.MappingNode {
			bad("a mapping of keys to values")
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			checkNode(n.Content[i+1], t.Elem(), join(path, n.Content[i].Value), out)
		}
	case reflect.String:
		if n.Kind != yaml.ScalarNode {
			bad("text")
		}
	case reflect.Bool:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
			bad("true or false")
		}
	case reflect.Int, reflect.Int64:
		if _, err := strconv.ParseInt(n.Value, 10, 64); n.Kind != yaml.ScalarNode || err != nil {
			bad("a whole number")
		}
	case reflect.Float64:
		if _, err := strconv.ParseFloat(n.Value, 64); n.Kind != yaml.ScalarNode || err != nil {
			bad("a number")
		}
	}
}

// jsonFields maps a struct's JSON names to its fields.
func jsonFields(t reflect.Type) map[string]reflect.StructField {
	m := map[string]reflect.StructField{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "" && name != "-" {
			m[name] = f
		}
	}
	return m
}

func knownKeys(t reflect.Type) string {
	var names []string
	for i := 0; i < t.NumField(); i++ {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ","); name != "" && name != "-" {
			names = append(names, name)
		}
	}
	return strings.Join(names, ", ")
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func where(path string) string {
	if path == "" {
		return "the document"
	}
	return path
}

// describe names a node's value for a message: its text for a scalar, else its kind.
func describe(n *yaml.Node, path string) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	if mayEcho(path) && len(n.Value) <= 40 {
		return strconv.Quote(n.Value)
	}
	switch n.Tag {
	case "!!int", "!!float":
		return "a number"
	case "!!bool":
		return "true or false"
	}
	return "text" // not echoed: it may be a key (a file given as the configuration, a misplaced secret)
}

// mayEcho reports whether a value at path may be shown in an error: never the document itself
// (a key file given as the configuration), nor anything named like a credential or a URL.
func mayEcho(path string) bool {
	if path == "" {
		return false
	}
	leaf := strings.ToLower(path[strings.LastIndexAny(path, ".]")+1:])
	for _, w := range []string{"key", "secret", "password", "token", "url", "store", "endpoint"} {
		if strings.Contains(leaf, w) {
			return false
		}
	}
	return true
}

// didYouMean words a suggestion ("" for none).
func didYouMean(name string) string {
	if name == "" {
		return ""
	}
	return " (did you mean " + name + "?)"
}

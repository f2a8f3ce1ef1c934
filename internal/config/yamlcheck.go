package config

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"

	yaml "go.yaml.in/yaml/v3"
)

// yamlProblems checks a YAML document against the shape of v's type before it is decoded, and
// reports every problem at once in plain words, each with its path and line: unknown keys
// ("workers[0].rol (line 5): unknown key; known keys: url, role, …") and values of the wrong
// kind ("workers[0].dp_size (line 9): want a whole number, got \"two\""). The decoder's own
// messages name Go types and stop at the first problem.
func yamlProblems(data []byte, v any) []string {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return []string{"not valid YAML: " + strings.TrimPrefix(err.Error(), "yaml: ")}
	}
	if len(doc.Content) == 0 {
		return nil
	}
	var out []string
	checkNode(doc.Content[0], reflect.TypeOf(v).Elem(), "", &out)
	return out
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
		*out = append(*out, fmt.Sprintf("%s (line %d): want %s, got %s", where(path), n.Line, want, describe(n)))
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yaml.MappingNode {
			bad("a mapping of keys to values")
			return
		}
		fields := jsonFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, val := n.Content[i], n.Content[i+1]
			f, ok := fields[k.Value]
			if !ok {
				*out = append(*out, fmt.Sprintf("%s (line %d): unknown key; known keys: %s", where(join(path, k.Value)), k.Line, knownKeys(t)))
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
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	return strconv.Quote(n.Value)
}

package config

import (
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
)

// A setting is declared once, by the tags of its Config field:
//
//	json     its YAML key (nested structs give dotted paths: health_check.interval)
//	flag     its command line flag, kebab case; none: YAML only
//	help     the flag's help, in --help and checked against the tables of docs/REFERENCE.md
//	default  its default, in flag syntax ("30s", "0.3", "round_robin"); none: the zero value
//	check    bounds: ">0", ">=N", "A..B" (numbers, or durations for a duration)
//	oneof    its choices: "a|b|c"
//	unit     a duration's integer alias, smg's spelling: "secs" or "ms" — the flag
//	         --<flag>-<unit> N and the YAML key <key>_<unit>: N
//	secret   the environment variable a key is read from too; a --<flag>-file flag reads it
//	         from a file
//	hint     what a value out of bounds is said with ("for one attempt, --disable-retries")
//	int      the unit of a bare integer the duration flag takes too, where smg's flag of the
//	         same name is a number ("secs": --eviction-interval 120)
//	reload   "live": a reload applies it to the running gateway (the routing policies and
//	         their parameters); every other setting needs a restart
//
// The flag set, --help, the defaults, the simple validation and the YAML aliases all come from
// this table; Validate adds the rules that tie settings together.
type setting struct {
	index []int        // the field's index path from Config
	key   string       // dotted YAML path
	flag  string       // "" for none
	help  string       // the flag's help
	def   string       // the default, in flag syntax
	check string       // bounds
	oneof []string     // choices
	hint  string       // said after a value out of bounds (tag hint)
	unit  string       // "secs" or "ms": a duration's alias
	typ   reflect.Type // the field's type
	// secret is the environment variable a secret setting is read from too (tag secret); it
	// also gets a --<flag>-file flag reading it from a file (a mounted Secret), so that keys
	// need not sit on the command line, where ps shows them.
	secret string
	// bareInt is the unit of a bare integer given to a duration flag that smg spells the same
	// and takes as a number (tag int: "secs"); 0: a bare integer is refused.
	bareInt time.Duration
	live    bool // a reload applies it (tag reload:"live")
}

var durationType = reflect.TypeOf(time.Duration(0))

// settings are Config's settings, in field order.
var settings = collectSettings(reflect.TypeOf(Config{}), nil, "")

// defaults is the Config every default tag fills in.
var defaults = func() Config {
	var c Config
	for _, s := range settings {
		if s.def == "" {
			continue
		}
		if err := s.set(&c, []string{s.def}); err != nil {
			panic(fmt.Sprintf("config: the default of %s: %v", s.key, err))
		}
	}
	return c
}()

func collectSettings(t reflect.Type, index []int, prefix string) []setting {
	var out []setting
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		key, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if key == "" || key == "-" {
			continue
		}
		idx := append(slices.Clone(index), i)
		if f.Type.Kind() == reflect.Struct {
			out = append(out, collectSettings(f.Type, idx, prefix+key+".")...)
			continue
		}
		s := setting{index: idx, key: prefix + key, flag: f.Tag.Get("flag"), help: f.Tag.Get("help"), def: f.Tag.Get("default"),
			check: f.Tag.Get("check"), unit: f.Tag.Get("unit"), typ: f.Type}
		s.bareInt, s.secret, s.hint = unitOf(f.Tag.Get("int")), f.Tag.Get("secret"), f.Tag.Get("hint")
		s.live = f.Tag.Get("reload") == "live"
		if o := f.Tag.Get("oneof"); o != "" {
			s.oneof = strings.Split(o, "|")
		}
		if s.flag == "" && s.def == "" && s.check == "" && s.unit == "" {
			continue // not a setting of its own (workers: YAML, --prefill, --decode)
		}
		if s.unit != "" && (s.typ != durationType || unitOf(s.unit) == 0) {
			panic("config: unit " + s.unit + " on " + s.key)
		}
		out = append(out, s)
	}
	return out
}

// unitOf is the duration a unit tag names.
func unitOf(unit string) time.Duration {
	switch unit {
	case "secs":
		return time.Second
	case "ms":
		return time.Millisecond
	}
	return 0
}

// field is the setting's field in c.
func (s *setting) field(c *Config) reflect.Value {
	return reflect.ValueOf(c).Elem().FieldByIndex(s.index)
}

// arg is the flag's placeholder in the usage.
func (s *setting) arg() string {
	switch {
	case s.typ == durationType:
		return "DURATION"
	case s.typ.Kind() == reflect.Bool:
		return ""
	case s.typ.Kind() == reflect.Int64:
		return "BYTES"
	case s.typ.Kind() == reflect.Int:
		return "N"
	case s.typ.Kind() == reflect.Float64:
		return "X"
	case s.typ.Kind() == reflect.Map:
		return "K=V..."
	case s.typ.Kind() == reflect.Slice:
		return "VALUE..."
	}
	return "STRING"
}

// set parses vals (a flag's values) into the setting's field of c.
func (s *setting) set(c *Config, vals []string) error {
	v := s.field(c)
	name := "--" + s.flag
	if s.flag == "" {
		name = s.key
	}
	switch {
	case s.typ == durationType:
		d, err := time.ParseDuration(vals[0])
		if n, ierr := strconv.ParseInt(vals[0], 10, 32); err != nil && ierr == nil && s.bareInt != 0 {
			d, err = time.Duration(n)*s.bareInt, nil // smg's spelling of this flag: whole seconds
		}
		if err != nil {
			return fmt.Errorf("%s: %q is not a duration (like 30s, 500ms, 2m)", name, vals[0])
		}
		v.SetInt(int64(d))
	case s.typ.Kind() == reflect.String:
		v.SetString(vals[0])
	case s.typ.Kind() == reflect.Bool:
		if len(vals) == 0 {
			v.SetBool(true)
			return nil
		}
		b, err := strconv.ParseBool(vals[0])
		if err != nil {
			return fmt.Errorf("%s: %q is not a boolean", name, vals[0])
		}
		v.SetBool(b)
	case s.typ.Kind() == reflect.Int, s.typ.Kind() == reflect.Int64:
		n, err := strconv.ParseInt(vals[0], 10, 64)
		if err != nil || v.OverflowInt(n) {
			return fmt.Errorf("%s: %q is not an integer", name, vals[0])
		}
		v.SetInt(n)
	case s.typ.Kind() == reflect.Float64:
		f, err := strconv.ParseFloat(vals[0], 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%s: %q is not a number", name, vals[0])
		}
		v.SetFloat(f)
	case s.typ.Kind() == reflect.Map:
		if v.IsNil() {
			v.Set(reflect.MakeMap(s.typ))
		}
		for _, arg := range vals {
			// key=value pairs, separated by spaces (smg's documented form) or commas
			// (Kubernetes' selector form, also in smg's guides): app=sglang,role=prefill.
			for kv := range strings.FieldsFuncSeq(arg, func(r rune) bool { return r == ',' || r == ' ' || r == '\t' }) {
				k, val, ok := strings.Cut(kv, "=")
				if !ok || k == "" {
					return fmt.Errorf("%s: %q is not key=value (pairs separated by spaces or commas: app=sglang role=prefill)", name, kv)
				}
				v.SetMapIndex(reflect.ValueOf(k), reflect.ValueOf(val))
			}
		}
	case s.typ.Kind() == reflect.Slice:
		v.Set(reflect.AppendSlice(v, reflect.ValueOf(splitURLs(vals))))
	default:
		return fmt.Errorf("%s: no flag syntax for %s", name, s.typ)
	}
	return nil
}

// setAlias parses a duration's integer alias (in its unit) into c.
func (s *setting) setAlias(c *Config, val string) error {
	n, err := strconv.ParseInt(val, 10, 64)
	unit := unitOf(s.unit)
	if err != nil || n > math.MaxInt64/int64(unit) || n < math.MinInt64/int64(unit) {
		return fmt.Errorf("--%s-%s: %q is not an integer", s.flag, s.unit, val)
	}
	s.field(c).SetInt(n * int64(unit))
	return nil
}

// format renders the setting's value in c in flag syntax ("" for an empty one).
func (s *setting) format(c *Config) string {
	v := s.field(c)
	switch {
	case s.typ == durationType:
		return formatDuration(time.Duration(v.Int()))
	case s.typ.Kind() == reflect.String:
		return v.String()
	case s.typ.Kind() == reflect.Bool:
		return strconv.FormatBool(v.Bool())
	case s.typ.Kind() == reflect.Int, s.typ.Kind() == reflect.Int64:
		return strconv.FormatInt(v.Int(), 10)
	case s.typ.Kind() == reflect.Float64:
		return strconv.FormatFloat(v.Float(), 'g', -1, 64)
	}
	return ""
}

// formatDuration writes d in its largest whole unit: 30m, 2m, 30s, 500ms (Go's "30m0s" is
// harder to read in a help text).
func formatDuration(d time.Duration) string {
	for _, u := range []struct {
		d    time.Duration
		name string
	}{{time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}, {time.Millisecond, "ms"}} {
		if d != 0 && d%u.d == 0 {
			return strconv.FormatInt(int64(d/u.d), 10) + u.name
		}
	}
	return d.String()
}

// validate checks the setting's value in c against its bounds and choices, with its hint.
func (s *setting) validate(c *Config) error {
	err := s.check1(c)
	if err != nil && s.hint != "" {
		err = fmt.Errorf("%w (%s)", err, s.hint)
	}
	return err
}

func (s *setting) check1(c *Config) error {
	if len(s.oneof) > 0 {
		if v := s.field(c).String(); !slices.Contains(s.oneof, v) {
			return fmt.Errorf("%s %q is unknown (want %s)", s.key, v, strings.Join(s.oneof, " or "))
		}
	}
	if s.check == "" {
		return nil
	}
	got, lo, hi, err := s.bounds(c)
	if err != nil {
		panic(fmt.Sprintf("config: check of %s: %v", s.key, err))
	}
	show := s.format(c)
	switch {
	case s.check == ">0":
		if got <= 0 {
			return fmt.Errorf("%s must be positive, got %s", s.key, show)
		}
	case strings.HasPrefix(s.check, ">="):
		if got < lo {
			return fmt.Errorf("%s must be at least %s, got %s", s.key, s.check[2:], show)
		}
	default:
		if got < lo || got > hi {
			a, b, _ := strings.Cut(s.check, "..")
			return fmt.Errorf("%s %s is out of range %s-%s", s.key, show, a, b)
		}
	}
	return nil
}

// bounds returns the setting's value in c and its check's bounds, as numbers.
func (s *setting) bounds(c *Config) (got, lo, hi float64, err error) {
	v := s.field(c)
	num := func(text string) (float64, error) {
		if s.typ == durationType {
			d, err := time.ParseDuration(text)
			return float64(d), err
		}
		return strconv.ParseFloat(text, 64)
	}
	if s.typ.Kind() == reflect.Float64 {
		got = v.Float()
	} else {
		got = float64(v.Int())
	}
	switch {
	case s.check == ">0":
	case strings.HasPrefix(s.check, ">="):
		lo, err = num(s.check[2:])
	default:
		a, b, ok := strings.Cut(s.check, "..")
		if !ok {
			return 0, 0, 0, fmt.Errorf("%q is no check", s.check)
		}
		if lo, err = num(a); err == nil {
			hi, err = num(b)
		}
	}
	return got, lo, hi, err
}

// Changed returns the YAML keys of the settings whose values differ between a and b (the
// workers aside: they are no setting of their own), split into those a reload applies (live)
// and those that need a restart.
func Changed(a, b Config) (live, restart []string) {
	for i := range settings {
		s := &settings[i]
		if reflect.DeepEqual(s.field(&a).Interface(), s.field(&b).Interface()) {
			continue
		}
		if s.live {
			live = append(live, s.key)
		} else {
			restart = append(restart, s.key)
		}
	}
	return live, restart
}

// WithLive returns a with b's values of the settings a reload applies (reload:"live"): the
// configuration a gateway runs with after a reload that needed no restart for them.
func WithLive(a, b Config) Config {
	for i := range settings {
		if s := &settings[i]; s.live {
			s.field(&a).Set(s.field(&b))
		}
	}
	return a
}

// fromEnvironment sets every secret setting whose environment variable is set.
func fromEnvironment(c *Config, getenv func(string) string) {
	for i := range settings {
		s := &settings[i]
		if s.secret == "" {
			continue
		}
		if v := getenv(s.secret); v != "" {
			s.field(c).SetString(v)
		}
	}
}

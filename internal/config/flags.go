package config

import (
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// ErrHelp is returned by Parse when -h or --help was given; the usage has been written.
var ErrHelp = errors.New("help requested")

// flag is one command line flag. Flags are long, kebab case, smg-compatible: "--name value",
// "--name=value", and for lists "--name v1 v2 ..." (values up to the next "--flag").
type flag struct {
	name string
	arg  string // placeholder in usage; empty for booleans
	list bool
	// optPort: one value, then an optional second one when it is an integer or "none"
	// (--prefill URL [BOOTSTRAP_PORT|none]).
	optPort bool
	// optConnector: then an optional KV connector name (nixl, MooncakeConnector, …), passed
	// on as "connector=NAME".
	optConnector bool
	help         string
	alias        bool // smg's integer spelling of a duration flag
	apply        func(c *Config, vals []string) error
	// def reads the flag's value from a Config, for the usage's "(default ...)"; nil: none shown.
	def func(c *Config) string
}

// serveFlags are the serve command's flags: --config, one per setting that has a flag (and
// the integer alias of a duration's), and --prefill and --decode after --pd-disaggregation.
var serveFlags = buildFlags()

func buildFlags() []flag {
	fs := []flag{{name: "config", arg: "FILE", help: "YAML configuration file (strict: unknown keys are errors); flags override it"}}
	for i := range settings {
		s := &settings[i]
		if s.flag == "" {
			continue
		}
		kind := s.typ.Kind()
		fs = append(fs, flag{name: s.flag, arg: s.arg(), list: kind == reflect.Map || kind == reflect.Slice, help: s.help, apply: s.set, def: s.format})
		if s.unit != "" {
			fs = append(fs, flag{name: s.flag + "-" + s.unit, arg: "N", alias: true,
				help:  fmt.Sprintf("--%s as a whole number of %s (smg's spelling)", s.flag, map[string]string{"secs": "seconds", "ms": "milliseconds"}[s.unit]),
				apply: func(c *Config, v []string) error { return s.setAlias(c, v[0]) },
				def:   func(c *Config) string { return strconv.FormatInt(s.field(c).Int()/int64(unitOf(s.unit)), 10) }})
		}
		if s.secret != "" {
			fs = append(fs, flag{name: s.flag + "-file", arg: "FILE", alias: true,
				help: fmt.Sprintf("--%s read from a file (a mounted Secret); or the %s variable", s.flag, s.secret),
				apply: func(c *Config, v []string) error {
					b, err := ReadFile(v[0], MaxSmallFile)
					if err != nil {
						return fmt.Errorf("--%s-file: %w", s.flag, err)
					}
					key := strings.TrimRight(string(b), "\r\n")
					if key == "" || strings.ContainsAny(key, "\r\n") {
						return fmt.Errorf("--%s-file %s: want one line holding the key", s.flag, v[0])
					}
					s.field(c).SetString(key)
					return nil
				}})
		}
		if s.flag == "pd-disaggregation" {
			fs = append(fs, prefillFlag, decodeFlag)
		}
		if s.flag == "api-key" {
			fs = append(fs, tenantKeyFlag)
		}
		if s.flag == "admin-api-key" {
			fs = append(fs, controlPlaneKeyFlag)
		}
		if s.flag == "default-model" {
			fs = append(fs, modelAliasFlag)
		}
	}
	return fs
}

var prefillFlag = flag{name: "prefill", arg: "URL [BOOTSTRAP_PORT|none] [CONNECTOR]", optPort: true, optConnector: true,
	help: "a prefill worker (repeatable); the bootstrap port SGLang legs name (Mooncake's, else 8998); its KV connector (nixl, mooncake, or vLLM's name; default --kv-connector)",
	apply: func(c *Config, v []string) error {
		w := Worker{URL: v[0], Role: RolePrefill}
		for _, extra := range v[1:] {
			if name, ok := strings.CutPrefix(extra, "connector="); ok {
				w.KVConnector = name
				continue
			}
			if extra == "none" {
				continue
			}
			n, err := strconv.Atoi(extra)
			if err != nil {
				return fmt.Errorf("--prefill %s: bootstrap port %q is not an integer", v[0], extra)
			}
			w.BootstrapPort = &n
		}
		c.Workers = append(c.Workers, w)
		return nil
	}}

var tenantKeyFlag = flag{name: "tenant-api-key", arg: "TENANT:KEY",
	help: "a key of a tenant (repeatable, smg's form; the tenant is created when the configuration has none of that name); prefer the hashed keys of the tenants: section",
	apply: func(c *Config, v []string) error {
		c.TenantAPIKeys = append(c.TenantAPIKeys, v[0])
		return nil
	}}

// controlPlaneKeyFlag is smg's --control-plane-api-keys ID:NAME:ROLE:KEY: an admin API key.
// smg's admin role is Baton's one admin role; its user role has no equivalent in Baton's admin
// API (clients' keys are tenants' keys), so it is refused.
var controlPlaneKeyFlag = flag{name: "control-plane-api-keys", arg: "ID:NAME:ROLE:KEY",
	help: "an admin API key in smg's form (repeatable; role admin): as --admin-api-key",
	apply: func(c *Config, v []string) error {
		parts := strings.SplitN(v[0], ":", 4)
		if len(parts) != 4 || parts[3] == "" {
			return fmt.Errorf("--control-plane-api-keys: want ID:NAME:ROLE:KEY (smg's form)")
		}
		if role := strings.ToLower(parts[2]); role != "admin" {
			return fmt.Errorf("--control-plane-api-keys %s:%s: role %q: Baton's admin API has one role, admin (a client's key belongs in tenants:, or --client-api-key)", parts[0], parts[1], parts[2])
		}
		c.ControlPlaneKeys = append(c.ControlPlaneKeys, parts[3])
		return nil
	}}

var modelAliasFlag = flag{name: "model-alias", arg: "ALIAS=MODEL",
	help: "a name clients may use for a model the workers serve (repeatable; the body's model is rewritten to MODEL on the way to the worker); the models: section says more",
	apply: func(c *Config, v []string) error {
		alias, model, ok := strings.Cut(v[0], "=")
		alias, model = strings.TrimSpace(alias), strings.TrimSpace(model)
		if !ok || alias == "" || model == "" || alias == model {
			return fmt.Errorf("--model-alias %q: want ALIAS=MODEL, two different names", v[0])
		}
		if c.Models == nil {
			c.Models = map[string]ModelConfig{}
		}
		m := c.Models[alias]
		if m.Serve != "" && m.Serve != model {
			return fmt.Errorf("--model-alias %s: given twice, for %s and %s: give one", alias, m.Serve, model)
		}
		m.Serve = model
		c.Models[alias] = m
		return nil
	}}

var decodeFlag = flag{name: "decode", arg: "URL [CONNECTOR]", optConnector: true,
	help: "a decode worker (repeatable); its KV connector (nixl, mooncake, or vLLM's name; default --kv-connector), so that flags alone can pair a mixed fleet",
	apply: func(c *Config, v []string) error {
		w := Worker{URL: v[0], Role: RoleDecode}
		if len(v) > 1 {
			w.KVConnector, _ = strings.CutPrefix(v[1], "connector=")
		}
		c.Workers = append(c.Workers, w)
		return nil
	}}

// isConnectorArg reports whether s, after a worker's URL, names a KV connector.
func isConnectorArg(s string) bool {
	if strings.HasPrefix(s, "-") {
		return false
	}
	_, ok := KVConnectorMode(s)
	return ok && !strings.HasPrefix(strings.TrimSpace(s), "{")
}

// Parse builds the serve configuration from defaults, then the --config file if given, then
// the other flags, and validates it. Every flag and validation problem is reported at once.
func Parse(args []string, usage io.Writer) (Config, error) {
	byName := map[string]*flag{}
	for i := range serveFlags {
		byName[serveFlags[i].name] = &serveFlags[i]
	}
	type setting struct {
		f    *flag
		vals []string
	}
	var (
		settings []setting
		errs     []error
		path     string
	)
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "-h" || a == "--help" || a == "-help" {
			writeUsage(usage)
			return Config{}, ErrHelp
		}
		if !strings.HasPrefix(a, "--") {
			if n, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "="); strings.HasPrefix(a, "-") && byName[n] != nil {
				errs = append(errs, fmt.Errorf("unknown flag %s: did you mean --%s?", a, n))
				continue
			}
			errs = append(errs, unexpected(args, i))
			continue
		}
		name, val, hasVal := strings.Cut(a[2:], "=")
		if alias, ok := smgAliases[name]; ok {
			name = alias
		}
		f, ok := byName[name]
		if !ok {
			errs = append(errs, errors.New(unknownFlag(name, byName)))
			// The unknown flag's values are not arguments of their own (nor echoed: a password).
			for !hasVal && i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
				i++
			}
			continue
		}
		var vals []string
		switch {
		case hasVal:
			vals = []string{val}
		case f.arg == "": // boolean without a value
		case f.list:
			for i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
				i++
				vals = append(vals, args[i])
			}
			if len(vals) == 0 {
				errs = append(errs, fmt.Errorf("--%s needs at least one value", name))
				continue
			}
		default:
			if i+1 >= len(args) || strings.HasPrefix(args[i+1], "--") {
				errs = append(errs, fmt.Errorf("--%s needs a value", name))
				continue
			}
			i++
			vals = []string{args[i]}
			if f.optPort && i+1 < len(args) && isPortArg(args[i+1]) {
				i++
				vals = append(vals, args[i])
			}
			if f.optConnector && i+1 < len(args) && isConnectorArg(args[i+1]) {
				i++
				vals = append(vals, "connector="+args[i])
			}
		}
		if name == "config" {
			path = vals[0]
			continue
		}
		settings = append(settings, setting{f, vals})
	}
	cfg := Default()
	cfg.Args, cfg.File = slices.Clone(args), path
	fromEnvironment(&cfg, os.Getenv)
	if env := os.Getenv("CONTROL_PLANE_API_KEYS"); env != "" { // smg reads its flag from it too
		for entry := range strings.SplitSeq(env, ",") {
			if err := controlPlaneKeyFlag.apply(&cfg, []string{strings.TrimSpace(entry)}); err != nil {
				errs = append(errs, fmt.Errorf("CONTROL_PLANE_API_KEYS: %w", err))
			}
		}
	}
	if path != "" {
		if err := cfg.LoadFile(path); err != nil {
			errs = append(errs, err)
		}
	}
	for _, s := range settings {
		if err := s.f.apply(&cfg, s.vals); err != nil {
			errs = append(errs, err)
		}
	}
	if err := cfg.applySmgFiles(); err != nil {
		errs = append(errs, err)
	}
	if err := cfg.Validate(); err != nil {
		errs = append(errs, err)
	}
	if _, err := cfg.ResolvedTenants(os.Getenv); err != nil {
		errs = append(errs, err)
	}
	return cfg, errors.Join(errs...)
}

func writeUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: baton [serve|check] [flags]   (check: send every PD pair one request, report its handoff)")
	fmt.Fprintln(w, "       baton sim|demo|bench [flags]  (see 'baton sim --help')")
	fmt.Fprintln(w, "       baton epp [flags]                 (the Endpoint Picker: these flags and --grpc-port)")
	fmt.Fprintln(w, "       baton epp-conformance --target HOST:PORT --model NAME [--tls] [--load N]  (check any Endpoint Picker)")
	fmt.Fprintln(w, "       baton hash-key < key.txt          (a tenant key as the configuration takes it)")
	fmt.Fprintln(w, "       baton version")
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	d := Default()
	for _, f := range serveFlags {
		help := strings.ReplaceAll(f.help, "{policies}", strings.Join(Policies, " | ")) // every registered one
		if f.def != nil {
			if v := f.def(&d); v != "" && v != "0" && v != "false" {
				help += " (default " + v + ")"
			}
		}
		fmt.Fprintf(tw, "  --%s %s\t%s\n", f.name, f.arg, help)
	}
	_ = tw.Flush()
}

func isPortArg(s string) bool {
	if s == "none" {
		return true
	}
	_, err := strconv.Atoi(s)
	return err == nil
}

// unexpected is the error for args[i], an argument no flag takes. It does not echo it — it may
// be a password or a URL with one, given to a flag Baton does not have — but says where it is.
func unexpected(args []string, i int) error {
	if i > 0 && strings.HasPrefix(args[i-1], "-") {
		return fmt.Errorf("unexpected argument after %s (argument %d, not shown)", strings.SplitN(args[i-1], "=", 2)[0], i+1)
	}
	return fmt.Errorf("unexpected argument %d (not shown: give flags as --name value)", i+1)
}

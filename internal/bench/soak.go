package bench

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/discovery"
	"github.com/baton-llm/baton/internal/k8stest"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/redistest"
	"github.com/baton-llm/baton/internal/sim"
)

// The soak scenario: a mixed workload through a regular Baton and a PD Baton for a long time
// while a fault schedule runs, every answer checked against its request. Outcomes a client can
// act on are counted; anything else fails the run: a 200 with another request's content, a
// request unanswered past the deadline, a connection closed without an answer, a status no
// fault explains, goroutines that do not come back after the load.

// Soak outcomes.
const (
	soakOK        = "ok"           // 200, every id the request's
	soakRefused   = "refused"      // 429, 503 or 504 in the OpenAI envelope
	soakBadGW     = "bad_gateway"  // 502 in the OpenAI envelope, naming the worker
	soakEngineErr = "engine_error" // an engine's own 5xx, relayed as it said it (retries spent)
	soakCut       = "cut"          // a stream (or body) that began and was aborted: its engine went
	soakLeft      = "client_left"  // the client hung up on purpose
	soakMixed     = "MIXED"        // content of another request
	soakHang      = "HANG"         // unanswered past the request deadline
	soakReset     = "RESET"        // the connection closed before any answer
	soakUnexpect  = "UNEXPECTED"   // a status or body no fault explains
	soakRequestTO = 10 * time.Second
)

var soakOutcomes = []string{soakOK, soakRefused, soakBadGW, soakEngineErr, soakCut, soakLeft, soakMixed, soakHang, soakReset, soakUnexpect}

// soakFailing are the outcomes that fail the run.
var soakFailing = []string{soakMixed, soakHang, soakReset, soakUnexpect}

// fixedSim is a simulated engine that can be stopped and started again on its ports (API and
// KV events), with other faults; its token counters add up over its lives.
type fixedSim struct {
	name string
	cfg  sim.Config
	mu   sync.Mutex
	e    *sim.Engine
	// prompt and generated are the tokens of its earlier lives.
	prompt, generated int64
}

func startFixed(name string, c sim.Config) (*fixedSim, error) {
	e, err := engine(c)
	if err != nil {
		return nil, err
	}
	port := func(u string) int {
		n, _ := strconv.Atoi(u[strings.LastIndexByte(u, ':')+1:])
		return n
	}
	c.Port = port(e.URL())
	if c.KVEvents {
		c.KVEventsPort, c.KVEventsReplayPort = port(e.KVEventsEndpoint()), port(e.KVEventsReplayEndpoint())
	}
	return &fixedSim{name: name, cfg: c, e: e}, nil
}

// set stops the engine and, unless down, starts it again on its ports with faults f.
func (s *fixedSim) set(down bool, f sim.Faults) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.e != nil {
		st := s.e.Stats()
		s.e.Close()
		s.e = nil
		s.prompt += st.PromptTokensRemote + st.PromptTokensRecompute + st.PromptTokensLocalCache
		s.generated += st.TokensGenerated
	}
	if down {
		return nil
	}
	c := s.cfg
	c.Faults = f
	var err error
	for range 100 { // the ports are free again once the old listeners are gone
		if s.e, err = engine(c); err == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("%s: start again on port %d: %w", s.name, c.Port, err)
}

// tokens is the prompt tokens the engine computed or loaded, and the tokens it generated, over
// its lives: its own usage counters (vLLM's prompt_tokens_total and generation_tokens_total).
func (s *fixedSim) tokens() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.prompt + s.generated
	if s.e != nil {
		st := s.e.Stats()
		n += st.PromptTokensRemote + st.PromptTokensRecompute + st.PromptTokensLocalCache + st.TokensGenerated
	}
	return n
}

func (s *fixedSim) url() string { return fmt.Sprintf("http://127.0.0.1:%d", s.cfg.Port) }

func (s *fixedSim) kvEvents() string { return fmt.Sprintf("tcp://127.0.0.1:%d", s.cfg.KVEventsPort) }

func (s *fixedSim) close() { _ = s.set(true, sim.Faults{}) }

// collector is an OTLP/HTTP trace collector that can be stopped and started on its port.
type collector struct {
	addr  string
	mu    sync.Mutex
	srv   *http.Server
	spans atomic.Int64 // export requests taken
}

func startCollector() (*collector, error) {
	c := &collector{addr: "127.0.0.1:0"}
	if err := c.start(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *collector) start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var ln net.Listener
	var err error
	for range 100 {
		if ln, err = net.Listen("tcp", c.addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("OTLP collector: %w", err)
	}
	c.addr = ln.Addr().String()
	c.srv = &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 64<<20))
		c.spans.Add(1)
		w.Header().Set("Content-Type", "application/x-protobuf")
	})}
	go func() { _ = c.srv.Serve(ln) }()
	return nil
}

func (c *collector) stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.srv != nil {
		_ = c.srv.Close()
		c.srv = nil
	}
	return nil
}

// soakTally counts outcomes per phase, the latency of the answers that were whole, and each
// Baton's answers per second (for recovery times and the plot).
type soakTally struct {
	mu       sync.Mutex
	began    time.Time
	phases   []string
	counts   map[string]map[string]int
	lat      map[string][]time.Duration
	refLat   map[string][]time.Duration // of the refusals (429/503/504)
	seconds  [soakBatons][]soakSecond   // per Baton (regular, PD vLLM, PD SGLang, discovering), per second of the run
	noRetry  atomic.Int64               // 429/503/504 without Retry-After
	codes    sync.Map                   // "status code" of the refusals: *atomic.Int64
	problems []soakProblem
}

// soakProblem is a request that failed in a way no client can act on: what the client saw, and
// whose request it was (its Baton and id, to find what that Baton logged of it).
type soakProblem struct {
	text   string
	target int
	rid    string
}

// soakSecond is one second of a Baton's answers: whole, refused by a limit (429), and failed
// (any other outcome but the client's own hang-up).
type soakSecond struct{ ok, limited, failed int }

func (t *soakTally) add(target int, rid, phase, outcome string, status int, lat time.Duration, problem string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.counts[phase] == nil {
		t.counts[phase] = map[string]int{}
		t.phases = append(t.phases, phase)
	}
	t.counts[phase][outcome]++
	switch outcome {
	case soakOK:
		t.lat[phase] = append(t.lat[phase], lat)
	case soakRefused:
		t.refLat[phase] = append(t.refLat[phase], lat)
	}
	if problem != "" && len(t.problems) < 20 {
		t.problems = append(t.problems, soakProblem{fmt.Sprintf("[%s] %s: %s", phase, outcome, problem), target, rid})
	}
	sec := int(time.Since(t.began) / time.Second)
	for len(t.seconds[target]) <= sec {
		t.seconds[target] = append(t.seconds[target], soakSecond{})
	}
	s := &t.seconds[target][sec]
	switch {
	case outcome == soakOK:
		s.ok++
	case status == http.StatusTooManyRequests:
		s.limited++
	case outcome != soakLeft:
		s.failed++
	}
}

// soakBatons is the most Batons the soak runs: regular, PD vLLM NIXL, PD SGLang and, where a
// real API server can run, one that discovers its engines in Kubernetes.
const soakBatons = 4

// joinf formats each of vs with format, comma-separated.
func joinf(format string, vs []float64) string {
	out := make([]string, len(vs))
	for i, v := range vs {
		out[i] = fmt.Sprintf(format, v)
	}
	return strings.Join(out, ", ")
}

// soakSample is one sample of the Batons' goroutines and memory, and of the tokens charged
// to tenants against those the engines counted.
type soakSample struct {
	at                    time.Duration
	phase                 string
	goroutines            [soakBatons]float64
	rssMiB, heap          [soakBatons]float64
	charged, engineTokens float64
}

// soakProbe is where a fault must show: on the Baton p, one of metrics moved (a name, or a name
// and a label text: `baton_worker_health_checks_total{result="failed"`), a WARN or ERROR line
// matching log, and status.json passing status.
type soakProbe struct {
	p       *proc
	metrics []string
	log     *regexp.Regexp
	status  func(j string, since time.Time) bool
}

// breakerOpen reports whether status.json j shows the breaker of the worker at host open (or
// half-open: it opened).
func breakerOpen(j, host string) bool {
	var v struct {
		Workers []struct{ URL, Breaker string } `json:"workers"`
	}
	if json.Unmarshal([]byte(j), &v) != nil {
		return false
	}
	return slices.ContainsFunc(v.Workers, func(w struct{ URL, Breaker string }) bool {
		return strings.Contains(w.URL, host) && w.Breaker != "" && w.Breaker != "closed"
	})
}

// recentError reports whether status.json j lists an error since t whose worker contains worker
// and whose code contains code.
func recentError(j string, since time.Time, worker, code string) bool {
	var v struct {
		Errors []struct {
			At           time.Time `json:"at"`
			Worker, Code string
		} `json:"recent_errors"`
	}
	if json.Unmarshal([]byte(j), &v) != nil {
		return false
	}
	return slices.ContainsFunc(v.Errors, func(e struct {
		At           time.Time `json:"at"`
		Worker, Code string
	}) bool {
		return !e.At.Before(since) && strings.Contains(e.Worker, worker) && strings.Contains(e.Code, code)
	})
}

// soakSeen is when a fault showed after it began (0: not within the watch).
type soakSeen struct{ metric, log, status time.Duration }

const soakSeenWithin = 10 * time.Second

// metricSum sums the samples of name in a /metrics text whose labels contain filter ("": all).
func metricSum(text, name, filter string) float64 {
	sum := 0.0
	for _, line := range strings.Split(text, "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || rest == "" || rest[0] != ' ' && rest[0] != '{' || filter != "" && !strings.Contains(rest, filter) {
			continue
		}
		v, err := strconv.ParseFloat(rest[strings.LastIndexByte(rest, ' ')+1:], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

func getText(url string) string {
	resp, err := http.Get(url)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	return string(b)
}

// metricsOf sums each of a probe's metrics on its Baton now.
func (pr soakProbe) values() []float64 {
	text := getText(pr.p.MetricsURL)
	out := make([]float64, len(pr.metrics))
	for i, m := range pr.metrics {
		name, filter, _ := strings.Cut(m, "{")
		out[i] = metricSum(text, name, filter)
	}
	return out
}

// baseline is the probes' metrics before their fault begins.
func baseline(probes []soakProbe) [][]float64 {
	before := make([][]float64, len(probes))
	for i, pr := range probes {
		before[i] = pr.values()
	}
	return before
}

// watch polls the probes of a fault that began at began until each showed or 15 s passed; before
// is their metrics from before it began.
func watch(ctx context.Context, from, began time.Time, probes []soakProbe, before [][]float64) soakSeen {
	var seen soakSeen
	if len(probes) == 0 {
		return seen
	}
	for time.Since(began) < 15*time.Second && ctx.Err() == nil {
		at := time.Since(began)
		for i, pr := range probes {
			if seen.metric == 0 {
				for k, v := range pr.values() {
					if v != before[i][k] {
						seen.metric = at
					}
				}
			}
			if seen.log == 0 && pr.log != nil {
				for _, l := range pr.p.logs.alertsSince(from) { // a line while the fault began counts
					if pr.log.MatchString(l.line) {
						seen.log = max(l.at.Sub(began), time.Millisecond)
						break
					}
				}
			}
			if seen.status == 0 && pr.status != nil && pr.status(getText(strings.TrimSuffix(pr.p.MetricsURL, "/metrics")+"/status.json"), from.Add(-time.Second)) {
				seen.status = at
			}
		}
		if seen.metric != 0 && (seen.log != 0 || !hasLog(probes)) && (seen.status != 0 || !hasStatus(probes)) {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	return seen
}

func hasLog(ps []soakProbe) bool {
	return slices.ContainsFunc(ps, func(p soakProbe) bool { return p.log != nil })
}

func hasStatus(ps []soakProbe) bool {
	return slices.ContainsFunc(ps, func(p soakProbe) bool { return p.status != nil })
}

// soakKey is tenant alpha's rotating key of generation n.
func soakKey(n int) string { return fmt.Sprintf("sk-soak-alpha-%d", n) }

// soakTenants is the tenants' part of the soak's configuration files: alpha, its limit far above
// the load (every request reserved and settled, its charge counted), with a static key and, when
// rotating, the keys of generations n, n-1 and n-2 (clients use n-1 once n is written: a client
// that read its key just before holds n-2, still valid); beta under a limit the load goes past
// (429s).
func soakTenants(store string, rotating bool, n int) string {
	keys := []string{config.HashKey("sk-soak-alpha")}
	if rotating {
		keys = append(keys, config.HashKey(soakKey(n)), config.HashKey(soakKey(n-1)), config.HashKey(soakKey(n-2)))
	}
	return fmt.Sprintf("rate_limit_store: %s\ntenants:\n  - name: alpha\n    keys: [%s]\n    max_priority: critical\n    limits: {tokens_per_minute: 1000000000}\n"+
		"  - name: beta\n    keys: [%s]\n    max_priority: critical\n    limits: {tokens_per_minute: 60000}\n", store, strings.Join(keys, ", "), config.HashKey("sk-soak-beta"))
}

// soakPrompts are the workload's shared prefixes: cache-aware routing has something to find.
var soakPrompts = []string{
	"You are a careful assistant for a bank. Answer briefly and cite the policy section.",
	"You are a coding assistant. Prefer the standard library and explain each change.",
	"You are a travel planner. Give a day-by-day plan with costs in euros.",
	"You summarise legal documents for a non-lawyer in plain words and short lists.",
}

func (r *runner) soak(ctx context.Context) error {
	dur := r.o.Duration
	if dur == 0 {
		dur = 30 * time.Minute
		if r.o.Quick {
			dur = 3 * time.Minute
		}
	}
	if dur < time.Minute {
		return fmt.Errorf("soak: --duration %s: a soak runs a minute at least (its phases need seconds each)", dur)
	}
	fmt.Fprintln(r.out, "## 15. Soak: a mixed workload under a fault schedule")
	fmt.Fprintln(r.out)
	var sims []*fixedSim
	defer func() {
		for _, s := range sims {
			s.close()
		}
	}()
	start := func(name string, c sim.Config) (*fixedSim, error) {
		s, err := startFixed(name, c)
		if err == nil {
			sims = append(sims, s)
		}
		return s, err
	}
	regular := sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 2 * time.Millisecond, PrefixCache: true, KVEvents: true, RuntimeLoRA: true, MaxLoRAs: 4}
	var regs [3]*fixedSim
	for i := range regs {
		var err error
		if regs[i], err = start(fmt.Sprintf("regular-%d", i+1), regular); err != nil {
			return err
		}
	}
	r1, r2, r3 := regs[0], regs[1], regs[2]
	pre, err := start("prefill", sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	if err != nil {
		return err
	}
	dec, err := start("decode", sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, DecodePerToken: 2 * time.Millisecond})
	if err != nil {
		return err
	}
	sgPre, err := engine(sim.Config{Engine: sim.EngineSGLang, Role: sim.RolePrefill})
	if err != nil {
		return err
	}
	defer sgPre.Close()
	sgDec, err := start("sglang-decode", sim.Config{Engine: sim.EngineSGLang, Role: sim.RoleDecode, DecodePerToken: 2 * time.Millisecond})
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "baton-soak")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// Tenants' limits in a real Redis when the machine has one (CI installs it).
	store, redisNote := "memory", "tenants' limits counted in each Baton's memory (no redis-server on this machine: no Redis outage)"
	var redis *redistest.Server
	switch redis, err = redistest.New(dir); {
	case errors.Is(err, redistest.ErrNotInstalled):
		if os.Getenv("BATON_REQUIRE_REDIS") != "" {
			return fmt.Errorf("soak: BATON_REQUIRE_REDIS is set but %w", err)
		}
	case err != nil:
		return err
	default:
		defer redis.Stop()
		store, redisNote = redis.URL(), "tenants' limits shared in one real Redis (Debian's redis-server)"
	}
	otlp, err := startCollector()
	if err != nil {
		return err
	}
	defer otlp.stop()

	fileA, fileB := filepath.Join(dir, "regular.yaml"), filepath.Join(dir, "pd.yaml")
	writeA := func(n int, withThird bool) error {
		var b strings.Builder
		fmt.Fprintf(&b, "policy: cache_aware\nworkers:\n")
		ws := []*fixedSim{r1, r2}
		if withThird {
			ws = append(ws, r3)
		}
		for _, w := range ws {
			fmt.Fprintf(&b, "  - url: %s\n    kv_events_endpoint: %s\n", w.url(), w.kvEvents())
		}
		fmt.Fprintf(&b, "adapters:\n  - {name: soak-adapter, path: /adapters/soak, base: %s}\n", benchModel)
		b.WriteString(soakTenants(store, true, n))
		return os.WriteFile(fileA, []byte(b.String()), 0o600)
	}
	if err := writeA(1, false); err != nil {
		return err
	}
	if err := os.WriteFile(fileB, []byte(soakTenants(store, false, 0)), 0o600); err != nil {
		return err
	}
	common := []string{"--request-timeout", "10s", "--health-check-interval", "1s", "--max-concurrent-requests", "96", "--queue-size", "16",
		"--queue-timeout", "2s", "--cb-timeout-duration", "2s", "--stream-stall-timeout", "3s", "--max-tree-size", "1048576", "--log-level", "info",
		"--otlp-traces-endpoint", "http://" + otlp.addr}
	common = append(common, r.o.BatonFlags...)
	a, err := startBaton(r.o.Binary, -1, append([]string{"--config", fileA}, common...)...)
	if err != nil {
		return err
	}
	defer a.stop()
	b, err := startBaton(r.o.Binary, -1, append([]string{"--config", fileB, "--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", pre.url(), "--decode", dec.url()}, common...)...)
	if err != nil {
		return err
	}
	defer b.stop()
	c, err := startBaton(r.o.Binary, -1, append([]string{"--config", fileB, "--pd-disaggregation", "--prefill", sgPre.URL(), fmt.Sprint(sgPre.BootstrapPort()), "--decode", sgDec.url()}, common...)...)
	if err != nil {
		return err
	}
	defer c.stop()
	batons := []*proc{a, b, c}
	batonNames := []string{"regular", "PD vLLM NIXL", "PD SGLang"}
	// A Baton that discovers two engines in Kubernetes, over a real API server where its binaries
	// are built (scripts/k8s-test-binaries.sh; CI builds them).
	kubeNote := "no Kubernetes API server on this machine (scripts/k8s-test-binaries.sh builds one): no discovering Baton"
	var kube *k8stest.Server
	var kubeSims []*fixedSim
	if assets := k8stest.Assets(); assets != "" {
		var d *proc
		kube, kubeSims, d, err = r.soakKube(ctx, assets, start, append([]string{"--config", fileB}, common...))
		if kube != nil {
			defer kube.Stop()
		}
		if d != nil {
			defer d.stop()
		}
		if err != nil {
			return err
		}
		batons, batonNames = append(batons, d), append(batonNames, "discovering")
		kubeNote = "a fourth Baton discovering two vLLM engines as pods through a real kube-apiserver " + k8stest.Version
	} else if os.Getenv("BATON_REQUIRE_K8S") != "" {
		return errors.New("soak: BATON_REQUIRE_K8S is set but " + kubeNote)
	}

	// The fault schedule: a steady start, each fault for a step, a steady end.
	type fault struct {
		name       string
		target     int // the Baton whose answers it hurts, for its recovery time (-1: all)
		begin, end func() error
		probes     []soakProbe
	}
	none := func() error { return nil }
	host := func(s *fixedSim) string { return fmt.Sprintf("127.0.0.1:%d", s.cfg.Port) }
	engineDown := func(p *proc, s *fixedSim) []soakProbe {
		return []soakProbe{{p: p, metrics: []string{`baton_worker_health_checks_total{result="failed"`, "baton_upstream_errors_total"},
			log:    regexp.MustCompile(regexp.QuoteMeta(host(s))),
			status: func(j string, _ time.Time) bool { return strings.Contains(j, `"health":"unhealthy"`) }}}
	}
	var burst atomic.Bool
	var burstRound sync.Mutex // held while a round of the burst's clients is under way
	faults := []fault{
		{"steady", -1, none, none, nil},
		{"burst far over capacity", 0, func() error { burst.Store(true); return nil }, func() error {
			burst.Store(false)
			burstRound.Lock() // the round under way ends
			defer burstRound.Unlock()
			r.client.CloseIdleConnections() // the burst's clients are gone
			return nil
		},
			[]soakProbe{{p: a, metrics: []string{"baton_rejections_total", "baton_queue_depth"}, log: regexp.MustCompile(`shedding load`),
				status: func(j string, t time.Time) bool { return recentError(j, t, "", "queue_") }}}},
		{"regular engine killed", 0, func() error { return r1.set(true, sim.Faults{}) }, func() error { return r1.set(false, sim.Faults{}) }, engineDown(a, r1)},
		{"decode engine killed", 1, func() error { return dec.set(true, sim.Faults{}) }, func() error { return dec.set(false, sim.Faults{}) }, engineDown(b, dec)},
		{"regular engine answers 500", 0, func() error { return r2.set(false, sim.Faults{Status: 500}) }, func() error { return r2.set(false, sim.Faults{}) },
			[]soakProbe{{p: a, metrics: []string{"baton_upstream_errors_total", "baton_retries_total"}, log: regexp.MustCompile(regexp.QuoteMeta(host(r2))),
				status: func(j string, t time.Time) bool { return breakerOpen(j, host(r2)) || recentError(j, t, host(r2), "") }}}},
		{"prefill engine killed", 1, func() error { return pre.set(true, sim.Faults{}) }, func() error { return pre.set(false, sim.Faults{}) }, engineDown(b, pre)},
		{"regular engine hangs mid-stream", 0, func() error { return r1.set(false, sim.Faults{HangAfter: 2}) }, func() error { return r1.set(false, sim.Faults{}) },
			[]soakProbe{{p: a, metrics: []string{`baton_upstream_errors_total{kind="stalled"`}, log: regexp.MustCompile(`sent nothing mid-stream.*` + regexp.QuoteMeta(host(r1))),
				// After the first seconds: the engine's restart into the fault cut the streams it had.
				status: func(j string, t time.Time) bool {
					return recentError(j, t.Add(2*time.Second), host(r1), openai.CodeCutMidAnswer)
				}}}},
	}
	if kube != nil {
		faults = append(faults, fault{"Kubernetes API server restarted", 3, func() error { kube.StopAPIServer(); return nil },
			func() error { return kube.StartAPIServer(ctx) },
			[]soakProbe{{p: batons[3], metrics: []string{"baton_service_discovery_connected"}, log: regexp.MustCompile(`(?i)API server`),
				status: func(j string, _ time.Time) bool { return strings.Contains(j, "API server has not answered") }}}})
	}
	if redis != nil {
		var ps []soakProbe
		for _, p := range batons {
			ps = append(ps, soakProbe{p: p, metrics: []string{"baton_rate_limit_store_up"}, log: regexp.MustCompile(`(?i)redis|rate limit store`),
				status: func(j string, _ time.Time) bool { return strings.Contains(j, "cannot be reached") }})
		}
		faults = append(faults, fault{"Redis stopped", -1, func() error { redis.Stop(); return nil }, redis.StartAgain, ps})
	}
	faults = append(faults,
		fault{"OTLP collector stopped", -1, otlp.stop, otlp.start, []soakProbe{{p: a, metrics: []string{"baton_trace_export_failures_total"},
			log: regexp.MustCompile(`(?i)trace export`), status: func(j string, _ time.Time) bool { return strings.Contains(j, "Trace export to") }}}},
		fault{"steady (recovery)", -1, none, none, nil},
	)
	step := dur / time.Duration(len(faults))
	fmt.Fprintf(r.out, "%s in %d phases of %s. Batons: regular (cache_aware over three vLLM engines with KV events, two of them in the configuration and the third added and removed by a reload every 10 s that also rotates a tenant's key; a LoRA adapter loaded by Baton), PD vLLM NIXL and PD SGLang; %s; %s; traces at 100 %% sampling to an OTLP collector; a stream stall timeout of 3 s; a cache-aware index of 1 MiB of prompts (full within the warm-up: its growth is no creep). 16 clients, half streaming, 5 %% hanging up at a random moment; two tenants (alpha, limit far above the load; beta, 60,000 tokens a minute, past which it gets 429s), every request in a random priority class, a quarter of the regular Baton's requests for the adapter; request deadline %s. Every answer is checked: a 200's ids must be its request's.\n\n",
		dur.Round(time.Second), len(faults), step.Round(time.Second), kubeNote, redisNote, soakRequestTO)

	began := time.Now()
	tally := &soakTally{began: began, counts: map[string]map[string]int{}, lat: map[string][]time.Duration{}, refLat: map[string][]time.Duration{}}
	var phase atomic.Pointer[string]
	setPhase := func(p string) { phase.Store(&p) }
	setPhase(faults[0].name)
	// Samples every 10 s (5 s in a short run); the first before any load.
	every := 10 * time.Second
	if r.o.Quick || dur < 5*time.Minute {
		every = 5 * time.Second
	}
	engineTokens := func() float64 {
		n := int64(0)
		for _, s := range append([]*fixedSim{r1, r2, r3, dec, sgDec}, kubeSims...) {
			n += s.tokens()
		}
		return float64(n)
	}
	var samples []soakSample
	var samplesMu sync.Mutex
	sample := func() {
		s := soakSample{at: time.Since(began), phase: *phase.Load(), engineTokens: engineTokens()}
		for k, p := range batons {
			text := getText(p.MetricsURL)
			s.goroutines[k], s.rssMiB[k], s.heap[k] = metricSum(text, "go_goroutines", ""), mib(p.rssBytes()), metricSum(text, "go_memstats_heap_inuse_bytes", "")/(1<<20)
			s.charged += metricSum(text, "baton_tenant_tokens_total", `kind="prompt"`) + metricSum(text, "baton_tenant_tokens_total", `kind="completion"`)
		}
		samplesMu.Lock()
		samples = append(samples, s)
		samplesMu.Unlock()
	}
	sample()
	// The load ends when the schedule does; a request the harness cut then is not counted.
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	var seq atomic.Int64
	var keyGen atomic.Int64 // the generation of alpha's rotating key clients use
	keyGen.Store(0)
	one := func(ctx context.Context) {
		i := seq.Add(1)
		p := *phase.Load()
		q := soakQuery{rid: fmt.Sprintf("soak-%d", i), stream: rand.IntN(2) == 0, leave: rand.IntN(20) == 0,
			model: benchModel, key: "sk-soak-alpha", priority: config.PriorityClasses[rand.IntN(len(config.PriorityClasses))],
			prompt: soakPrompts[i%int64(len(soakPrompts))]}
		target := 0
		switch i % 8 {
		case 4, 5:
			target = 1
		case 6:
			target = 2
		case 7:
			target = min(3, len(batons)-1)
		}
		switch {
		case i%4 == 3:
			q.key = "sk-soak-beta"
		case target == 0 && i%2 == 0:
			q.key = soakKey(int(keyGen.Load()))
		}
		if target == 0 && i%8 == 1 {
			q.model = "soak-adapter"
		}
		outcome, status, lat, problem := r.soakRequest(ctx, batons[target].URL, q, tally)
		if ctx.Err() != nil && outcome != soakOK {
			return // cut by the harness at the run's end
		}
		if problem != "" {
			problem = fmt.Sprintf("%s Baton, %s, stream %v, tenant key %s: %s", batonNames[target], q.model, q.stream, q.key, problem)
		}
		tally.add(target, q.rid, p, outcome, status, lat, problem)
	}
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for loadCtx.Err() == nil {
				one(loadCtx)
			}
		})
	}
	wg.Go(func() { // the burst: 400 more clients while it lasts
		for loadCtx.Err() == nil {
			if !burst.Load() {
				time.Sleep(50 * time.Millisecond)
				continue
			}
			burstRound.Lock()
			var bw sync.WaitGroup
			for range 400 {
				bw.Go(func() { one(loadCtx) })
			}
			bw.Wait()
			burstRound.Unlock()
		}
	})
	var reloads, reloadErrs int
	wg.Go(func() { // a configuration reload every 10 s: the third engine added or removed, alpha's key rotated
		t := time.NewTicker(10 * time.Second)
		defer t.Stop()
		with := false
		for n := 2; ; n++ {
			select {
			case <-loadCtx.Done():
				return
			case <-t.C:
			}
			with = !with
			// Generations n-1 and n-2 are in the file before and after this reload: clients
			// move to n-1 until the next one.
			if err := writeA(n, with); err != nil || a.cmd.Process.Signal(syscall.SIGHUP) != nil {
				reloadErrs++
			}
			keyGen.Store(int64(n - 1))
			reloads++
		}
	})
	// The fault schedule, each fault watched where an operator looks.
	var faultErrs []string
	seen := make([]soakSeen, len(faults))
	starts, ends := make([]time.Duration, len(faults)), make([]time.Duration, len(faults))
	var watchers sync.WaitGroup
	// Samples on their own clock, whatever a fault's start or end takes.
	sampling, stopSampling := context.WithCancel(ctx)
	var sampler sync.WaitGroup
	sampler.Go(func() {
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-tick.C:
				sample()
			case <-sampling.Done():
				return
			}
		}
	})
	for k, f := range faults {
		before, from := baseline(f.probes), time.Now()
		setPhase(f.name)
		starts[k] = time.Since(began)
		if err := f.begin(); err != nil {
			faultErrs = append(faultErrs, err.Error())
		}
		at := time.Now() // in effect: an API server's graceful stop answers until it ends
		watchers.Go(func() { seen[k] = watch(ctx, from, at, f.probes, before) })
		// On the schedule, but a whole step in effect however long the last fault took to end
		// (an API server's restart on a loaded machine): a fault cut short would be "not seen".
		end := began.Add(time.Duration(k+1) * step)
		if full := at.Add(step); end.Before(full) {
			end = full
		}
		select {
		case <-time.After(time.Until(end)):
		case <-ctx.Done():
		}
		if err := f.end(); err != nil {
			faultErrs = append(faultErrs, err.Error())
		}
		ends[k] = time.Since(began)
	}
	stopSampling()
	sampler.Wait()
	stopLoad()
	wg.Wait()
	watchers.Wait()
	// Goroutines back where they were once the load is gone (the clients' idle connections
	// closed, so that Baton's connection goroutines end).
	r.client.CloseIdleConnections()
	base := samples[0].goroutines
	var leak [soakBatons]float64
	for k, p := range batons {
		for wait := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			leak[k] = p.metric("go_goroutines") - base[k]
			if leak[k] <= 5 || time.Now().After(wait) {
				break
			}
		}
	}
	// The engines' counters settle once every request has ended.
	time.Sleep(time.Second)
	sample()

	// The report.
	fmt.Fprintf(r.out, "| phase | %s | p50 ms | p99 ms | refusals' p50 ms |\n|---|%s---:|---:|---:|\n", strings.Join(soakOutcomes, " | "), strings.Repeat("---:|", len(soakOutcomes)))
	total := map[string]int{}
	for _, p := range tally.phases {
		row := make([]string, len(soakOutcomes))
		for i, o := range soakOutcomes {
			row[i] = fmt.Sprint(tally.counts[p][o])
			total[o] += tally.counts[p][o]
		}
		pct := func(lat []time.Duration, q float64) string {
			if len(lat) == 0 {
				return "–"
			}
			slices.Sort(lat)
			return fmt.Sprintf("%.1f", float64(lat[min(len(lat)-1, int(q*float64(len(lat))))].Microseconds())/1000)
		}
		fmt.Fprintf(r.out, "| %s | %s | %s | %s | %s |\n", p, strings.Join(row, " | "), pct(tally.lat[p], 0.5), pct(tally.lat[p], 0.99), pct(tally.refLat[p], 0.5))
	}
	fmt.Fprintln(r.out)
	fmt.Fprintf(r.out, "%d requests; %d configuration reloads (%d could not be sent); 429/503/504 without Retry-After: %d.\n\n", seq.Load(), reloads, reloadErrs, tally.noRetry.Load())
	var codes []string
	tally.codes.Range(func(k, v any) bool {
		codes = append(codes, fmt.Sprintf("%s: %d", k, v.(*atomic.Int64).Load()))
		return true
	})
	slices.Sort(codes)
	fmt.Fprintf(r.out, "Refusals by status and code: %s.\n\n", strings.Join(codes, ", "))

	// Where each fault showed, and how long its Baton took to answer as before.
	var unseen []string
	fmt.Fprintf(r.out, "**Every fault seen** (goal: a metric moved and a WARN or ERROR line within %s, the status page within %s — one refresh of 2 s after it), and the recovery: from the fault's end to the first second its Baton answered without a failure.\n\n", soakSeenWithin, soakSeenWithin)
	fmt.Fprintln(r.out, "| fault | metric after | log line after | status page after | recovery |\n|---|---:|---:|---:|---:|")
	for k, f := range faults {
		if f.probes == nil {
			continue
		}
		show := func(d time.Duration, what string, want bool) string {
			switch {
			case !want:
				return "–"
			case d == 0 || d > soakSeenWithin:
				unseen = append(unseen, f.name+": "+what)
				if d == 0 {
					return "**not seen**"
				}
				return fmt.Sprintf("**%.1f s**", d.Seconds())
			}
			return fmt.Sprintf("%.1f s", d.Seconds())
		}
		fmt.Fprintf(r.out, "| %s | %s | %s | %s | %s |\n", f.name, show(seen[k].metric, "metric", true), show(seen[k].log, "log line", hasLog(f.probes)),
			show(seen[k].status, "status page", hasStatus(f.probes)), tally.recovery(f.target, ends[k], step))
	}
	fmt.Fprintln(r.out)

	// Tokens charged to tenants against the engines' own counters, over the run and per minute.
	last := samples[len(samples)-1]
	dev := func(charged, engines float64) float64 {
		if engines == 0 {
			return 0
		}
		return (charged - engines) / engines
	}
	runDev := dev(last.charged, last.engineTokens)
	fmt.Fprintf(r.out, "**Tokens charged to tenants** (`baton_tenant_tokens_total`, prompt and completion, the three Batons) against the engines' own counters (prompt tokens computed or loaded and tokens generated by the regular and decode engines): %.0f charged, %.0f counted, %+.2f %% over the run (goal within 1 %%).\n\n", last.charged, last.engineTokens, 100*runDev)
	fmt.Fprintln(r.out, "| minute | phases | charged | engines | difference |\n|---|---|---:|---:|---:|")
	var worstRedis float64
	// Windows by the clock: from the first sample at or past each minute to the first at or past
	// the next (the last window: to the last sample, when it covers half a minute or more).
	at := func(t time.Duration) int {
		i, _ := slices.BinarySearchFunc(samples, t, func(s soakSample, t time.Duration) int { return cmp.Compare(s.at, t) })
		return min(i, len(samples)-1)
	}
	for m := 0; ; m++ {
		i, j := at(time.Duration(m)*time.Minute), at(time.Duration(m+1)*time.Minute)
		if i >= j || samples[j].at-samples[i].at < 30*time.Second {
			break
		}
		s0, s1 := samples[i], samples[j]
		var ph []string
		for _, s := range samples[i+1 : j+1] {
			if !slices.Contains(ph, s.phase) {
				ph = append(ph, s.phase)
			}
		}
		d := dev(s1.charged-s0.charged, s1.engineTokens-s0.engineTokens)
		if slices.Contains(ph, "Redis stopped") {
			worstRedis = max(worstRedis, math.Abs(d))
		}
		fmt.Fprintf(r.out, "| %s–%s | %s | %.0f | %.0f | %+.2f %% |\n", s0.at.Round(time.Second), s1.at.Round(time.Second), strings.Join(ph, ", "), s1.charged-s0.charged, s1.engineTokens-s0.engineTokens, 100*d)
	}
	fmt.Fprintln(r.out)
	if redis != nil {
		fmt.Fprintf(r.out, "Minutes that overlap the Redis outage: within %.2f %% (goal 5 %%).\n\n", 100*worstRedis)
	}

	fmt.Fprintf(r.out, "| t | phase | goroutines (%s) | RSS MiB | heap in use MiB |\n|---:|---|---:|---:|---:|\n", strings.Join(batonNames, ", "))
	for _, s := range samples {
		fmt.Fprintf(r.out, "| %s | %s | %s | %s | %s |\n", s.at.Round(time.Second), s.phase, joinf("%.0f", s.goroutines[:len(batons)]),
			joinf("%.1f", s.rssMiB[:len(batons)]), joinf("%.1f", s.heap[:len(batons)]))
	}
	// Memory's slope after warm-up: over the last 20 minutes of a long run, the last two thirds
	// of a short one.
	from := dur / 3
	if dur >= 30*time.Minute {
		from = dur - 20*time.Minute
	}
	var slopes []string
	var creeping []string
	for k, name := range batonNames {
		var xs, rss, heap []float64
		for _, s := range samples[:len(samples)-1] {
			if s.at >= from {
				xs, rss, heap = append(xs, s.at.Minutes()), append(rss, s.rssMiB[k]), append(heap, s.heap[k])
			}
		}
		rs, hs := 10*slope(xs, rss), 10*slope(xs, heap)
		slopes = append(slopes, fmt.Sprintf("%s %+.2f MiB RSS, %+.2f MiB heap", name, rs, hs))
		if dur >= 20*time.Minute && rs > 1 {
			creeping = append(creeping, fmt.Sprintf("%s's RSS grows %.2f MiB per 10 minutes", name, rs))
		}
	}
	fmt.Fprintf(r.out, "\nMemory's slope from %s on, per 10 minutes (goal ≤ 1 MB; judged on runs of 20 minutes or more): %s.\n\n", from.Round(time.Second), strings.Join(slopes, "; "))
	// Goroutines after the burst: back to the steady phase's level within its next phase.
	burstBack := "–"
	var burstStayed []string
	for k, f := range faults {
		if f.name != "burst far over capacity" || k+1 >= len(faults) {
			continue
		}
		var steadyMax, after [soakBatons]float64
		for j := range after {
			after[j] = -1
		}
		for _, s := range samples {
			for j := range batons {
				if s.phase == "steady" {
					steadyMax[j] = max(steadyMax[j], s.goroutines[j])
				}
				if s.phase == faults[k+1].name && s.at > ends[k]+3*time.Second && after[j] < 0 {
					after[j] = s.goroutines[j]
				}
			}
		}
		burstBack = fmt.Sprintf("%s against at most %s while steady", joinf("%.0f", after[:len(batons)]), joinf("%.0f", steadyMax[:len(batons)]))
		for j := range batons {
			if after[j] > steadyMax[j]+10 {
				burstStayed = append(burstStayed, fmt.Sprintf("%s's goroutines %.0f after the burst, at most %.0f while steady", batonNames[j], after[j], steadyMax[j]))
			}
		}
	}
	fmt.Fprintf(r.out, "Goroutines in the first sample 3 s after the burst: %s. Once the load ended, against the start: %s.\n\n", burstBack, joinf("%+.0f", leak[:len(batons)]))
	if r.o.Plot != "" {
		if err := soakPlot(r.o.Plot, tally, samples, faults2marks(faults, starts, func(f fault) string { return f.name }), batonNames); err != nil {
			return err
		}
		names := make([]string, len(faults))
		for i, f := range faults {
			names[i] = fmt.Sprintf("%d %s", i+1, f.name)
		}
		fmt.Fprintf(r.out, "The fault timeline: %s (phases: %s).\n\n", r.o.Plot, strings.Join(names, ", "))
	}
	var failed []string
	for _, o := range soakFailing {
		if total[o] > 0 {
			failed = append(failed, fmt.Sprintf("%d %s", total[o], o))
		}
	}
	if slices.ContainsFunc(leak[:], func(v float64) bool { return v > 5 }) {
		failed = append(failed, fmt.Sprintf("goroutines %s after the load", joinf("%+.0f", leak[:len(batons)])))
	}
	if total[soakOK] == 0 {
		failed = append(failed, "no request answered")
	}
	if n := tally.noRetry.Load(); n > 0 {
		failed = append(failed, fmt.Sprintf("%d refusals without Retry-After", n))
	}
	failed = append(failed, faultErrs...)
	failed = append(failed, creeping...)
	failed = append(failed, burstStayed...)
	if len(unseen) > 0 {
		failed = append(failed, "not seen within "+soakSeenWithin.String()+": "+strings.Join(unseen, "; "))
	}
	if math.Abs(runDev) > 0.01 {
		failed = append(failed, fmt.Sprintf("tenants charged %+.2f %% against the engines' counters over the run", 100*runDev))
	}
	if worstRedis > 0.05 {
		failed = append(failed, fmt.Sprintf("a minute across the Redis outage charged %.2f %% off the engines' counters", 100*worstRedis))
	}
	if len(failed) > 0 {
		fmt.Fprintf(r.out, "**Failed**: %s\n\n", strings.Join(failed, "; "))
		for _, p := range tally.problems {
			logged := "Baton's log holds no line of it"
			if line, ok := batons[p.target].logs.lineOf(p.rid); ok {
				logged = "Baton logged: " + line
			}
			fmt.Fprintf(r.out, "- %s (request %s; %s)\n", p.text, p.rid, logged)
		}
		fmt.Fprintln(r.out)
		r.failed = append(r.failed, "soak: "+strings.Join(failed, "; "))
	}
	return nil
}

// faults2marks names each phase's start for the plot.
func faults2marks[F any](faults []F, starts []time.Duration, name func(F) string) []soakMark {
	out := make([]soakMark, len(faults))
	for i, f := range faults {
		out[i] = soakMark{at: starts[i], name: name(f)}
	}
	return out
}

// soakMark is a phase's start on the plot.
type soakMark struct {
	at   time.Duration
	name string
}

// recovery is the time from a fault's end to the first second the Baton target answered
// without a failure ("–" for a fault of every Baton; "> step" when none came within a step).
func (t *soakTally) recovery(target int, end, step time.Duration) string {
	if target < 0 {
		return "–"
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	secs := t.seconds[target]
	for s := int(end / time.Second); s < len(secs) && time.Duration(s)*time.Second < end+step; s++ {
		if secs[s].failed == 0 && secs[s].ok > 0 {
			return fmt.Sprintf("%.0f s", max(0, (time.Duration(s)*time.Second-end).Seconds()))
		}
	}
	return "> " + step.Round(time.Second).String()
}

// slope is the least-squares slope of ys over xs.
func slope(xs, ys []float64) float64 {
	n := float64(len(xs))
	if n < 2 {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx, sy, sxx, sxy = sx+xs[i], sy+ys[i], sxx+xs[i]*xs[i], sxy+xs[i]*ys[i]
	}
	d := n*sxx - sx*sx
	if d == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / d
}

// soakQuery is one request of the soak's workload.
type soakQuery struct {
	rid, model, key, priority, prompt string
	stream, leave                     bool
}

// soakRequest sends one completion of q as its tenant's key and in its priority class, streamed
// or not, the client hanging up at a random moment when q.leave is set, and judges what came
// back (status: the answer's, 0 without one).
func (r *runner) soakRequest(ctx context.Context, base string, q soakQuery, t *soakTally) (outcome string, status int, lat time.Duration, problem string) {
	rid, stream, leave := q.rid, q.stream, q.leave
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":8,"ignore_eos":true,"stream":%v}`, q.model, q.prompt+" Request "+rid+".", stream)
	ctx, cancel := context.WithTimeout(ctx, soakRequestTO+5*time.Second)
	defer cancel()
	var left atomic.Bool
	if leave {
		t := time.AfterFunc(time.Duration(rand.IntN(30))*time.Millisecond, func() { left.Store(true); cancel() })
		defer t.Stop()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return soakUnexpect, 0, 0, err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", rid)
	req.Header.Set("Authorization", "Bearer "+q.key)
	req.Header.Set("X-Baton-Priority", q.priority)
	began := time.Now()
	resp, err := r.client.Do(req)
	if err != nil {
		o, _, p := soakTransportError(ctx, &left, err, false)
		return o, 0, 0, p
	}
	status = resp.StatusCode
	defer resp.Body.Close()
	b, rerr := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	lat = time.Since(began)
	if rerr != nil {
		o, _, p := soakTransportError(ctx, &left, rerr, true)
		return o, status, lat, p
	}
	switch resp.StatusCode {
	case http.StatusOK:
		if p := soakCheckIDs(b, rid, stream); p != "" {
			if strings.HasPrefix(p, "cut") {
				return soakCut, status, lat, ""
			}
			return soakMixed, status, lat, p
		}
		return soakOK, status, lat, ""
	case http.StatusTooManyRequests, http.StatusServiceUnavailable, http.StatusGatewayTimeout, http.StatusBadGateway, http.StatusInternalServerError:
		var env struct {
			Error struct {
				Message string `json:"message"`
				Code    any    `json:"code"`
			} `json:"error"`
		}
		if json.Unmarshal(b, &env) != nil || env.Error.Message == "" {
			return soakUnexpect, status, lat, fmt.Sprintf("%d without the OpenAI envelope: %.200s", resp.StatusCode, b)
		}
		switch resp.StatusCode {
		case http.StatusBadGateway:
			if !strings.Contains(env.Error.Message, "worker http://") {
				return soakUnexpect, status, lat, "a 502 that names no worker: " + env.Error.Message
			}
			return soakBadGW, status, lat, ""
		case http.StatusInternalServerError:
			if env.Error.Code == openai.CodeInternalError {
				return soakUnexpect, status, lat, "Baton's own 500: " + env.Error.Message
			}
			return soakEngineErr, status, lat, ""
		}
		if resp.Header.Get("Retry-After") == "" {
			t.noRetry.Add(1)
		}
		n, _ := t.codes.LoadOrStore(fmt.Sprintf("%d %v", resp.StatusCode, env.Error.Code), new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		return soakRefused, status, lat, ""
	}
	return soakUnexpect, status, lat, fmt.Sprintf("status %d: %.200s", resp.StatusCode, b)
}

// soakTransportError judges a request that ended without a whole answer: the client's own
// hang-up, the deadline passed (a hang), or the connection closed (before the head: a reset;
// after it: a cut answer).
func soakTransportError(ctx context.Context, left *atomic.Bool, err error, afterHead bool) (string, time.Duration, string) {
	switch {
	case left.Load():
		return soakLeft, 0, ""
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return soakHang, 0, err.Error()
	case afterHead:
		return soakCut, 0, ""
	}
	return soakReset, 0, err.Error()
}

// soakCheckIDs reports what is wrong with a 200's content for the request rid ("" nothing): an
// id that is not cmpl-<rid> (or one of its retries), a stream without its end ("cut…").
func soakCheckIDs(b []byte, rid string, stream bool) string {
	mine := func(id string) bool {
		rest, ok := strings.CutPrefix(id, "cmpl-"+rid)
		return ok && (rest == "" || strings.HasPrefix(rest, "-"))
	}
	var v struct {
		ID string `json:"id"`
	}
	if !stream {
		if err := json.Unmarshal(b, &v); err != nil {
			return "not a completion: " + err.Error()
		}
		if !mine(v.ID) {
			return fmt.Sprintf("answer %q for request %s", v.ID, rid)
		}
		return ""
	}
	events := bytes.Split(b, []byte("\n\n"))
	done := false
	for _, ev := range events {
		data, ok := bytes.CutPrefix(bytes.TrimSpace(ev), []byte("data: "))
		if !ok {
			continue
		}
		if string(data) == "[DONE]" {
			done = true
			continue
		}
		if err := json.Unmarshal(data, &v); err != nil {
			continue // an error event: judged by its stream's end
		}
		if v.ID != "" && !mine(v.ID) {
			return fmt.Sprintf("event %q for request %s", v.ID, rid)
		}
	}
	if !done {
		return "cut: no [DONE]"
	}
	return ""
}

// soakKube starts a real API server from assets, two vLLM engines (by start) as Ready pods of
// namespace soak labelled app=soak-engine, and a Baton with args discovering them; it returns
// once the Baton has both.
func (r *runner) soakKube(ctx context.Context, assets string, start func(string, sim.Config) (*fixedSim, error), args []string) (*k8stest.Server, []*fixedSim, *proc, error) {
	kube, err := k8stest.Start(ctx, assets)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("soak: the Kubernetes API server: %w", err)
	}
	cs, err := kubernetes.NewForConfig(kube.Config)
	if err != nil {
		return kube, nil, nil, err
	}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "soak"}}, metav1.CreateOptions{}); err != nil {
		return kube, nil, nil, err
	}
	var sims []*fixedSim
	for i := range 2 {
		e, err := start(fmt.Sprintf("discovered-%d", i+1), sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 2 * time.Millisecond})
		if err != nil {
			return kube, sims, nil, err
		}
		sims = append(sims, e)
		name := fmt.Sprintf("engine-%d", i+1)
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": "soak-engine"},
			Annotations: map[string]string{discovery.AnnotationPort: strconv.Itoa(e.cfg.Port)}},
			Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "engine", Image: "engine:soak"}}}}
		if _, err := cs.CoreV1().Pods("soak").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			return kube, sims, nil, err
		}
		// Running and Ready, as a kubelet would say.
		status := `{"status":{"phase":"Running","podIP":"127.0.0.1","podIPs":[{"ip":"127.0.0.1"}],"conditions":[{"type":"Ready","status":"True"}]}}`
		if _, err := cs.CoreV1().Pods("soak").Patch(ctx, name, types.MergePatchType, []byte(status), metav1.PatchOptions{}, "status"); err != nil {
			return kube, sims, nil, err
		}
	}
	d, err := startBatonServing(r.o.Binary, -1, append([]string{"--service-discovery", "--selector", "app=soak-engine", "--service-discovery-namespace", "soak",
		"--kubeconfig", kube.Kubeconfig}, args...)...)
	if err != nil {
		return kube, sims, nil, err
	}
	// The status page lists the workers (/workers is the admin's once there are tenants).
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		ws := getText(strings.TrimSuffix(d.MetricsURL, "/metrics") + "/status.json")
		if strings.Contains(ws, sims[0].url()) && strings.Contains(ws, sims[1].url()) && strings.Count(ws, `"health":"ready"`) == 2 {
			return kube, sims, d, nil
		}
		if time.Now().After(deadline) {
			return kube, sims, d, fmt.Errorf("soak: the discovering Baton did not find its two engines: %s", ws)
		}
	}
}

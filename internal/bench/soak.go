package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/baton-llm/baton/internal/openai"
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

// fixedSim is a simulated engine that can be stopped and started again on its port, with other
// faults.
type fixedSim struct {
	name string
	cfg  sim.Config
	mu   sync.Mutex
	e    *sim.Engine
}

func startFixed(name string, c sim.Config) (*fixedSim, error) {
	e, err := engine(c)
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(e.URL())
	if err != nil {
		e.Close()
		return nil, err
	}
	if c.Port, err = strconv.Atoi(u.Port()); err != nil {
		e.Close()
		return nil, err
	}
	return &fixedSim{name: name, cfg: c, e: e}, nil
}

// set stops the engine and, unless down, starts it again on its port with faults f.
func (s *fixedSim) set(down bool, f sim.Faults) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.e != nil {
		s.e.Close()
		s.e = nil
	}
	if down {
		return nil
	}
	c := s.cfg
	c.Faults = f
	var err error
	for range 50 { // the port is free again once the old listener is gone
		if s.e, err = engine(c); err == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("%s: start again on port %d: %w", s.name, c.Port, err)
}

func (s *fixedSim) url() string { return fmt.Sprintf("http://127.0.0.1:%d", s.cfg.Port) }

func (s *fixedSim) close() { _ = s.set(true, sim.Faults{}) }

// soakTally counts outcomes per phase, and the latency of the answers that were whole.
type soakTally struct {
	mu       sync.Mutex
	phases   []string
	counts   map[string]map[string]int
	lat      map[string][]time.Duration
	noRetry  atomic.Int64 // 429/503/504 without Retry-After
	codes    sync.Map     // "status code" of the refusals: *atomic.Int64
	problems []string
}

func (t *soakTally) add(phase, outcome string, lat time.Duration, problem string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.counts[phase] == nil {
		t.counts[phase] = map[string]int{}
		t.phases = append(t.phases, phase)
	}
	t.counts[phase][outcome]++
	if outcome == soakOK {
		t.lat[phase] = append(t.lat[phase], lat)
	}
	if problem != "" && len(t.problems) < 20 {
		t.problems = append(t.problems, fmt.Sprintf("[%s] %s: %s", phase, outcome, problem))
	}
}

// soakSample is one sample of both Batons' goroutines and memory.
type soakSample struct {
	at           time.Duration
	phase        string
	goroutines   [2]float64
	rssMiB, heap [2]float64
}

func (r *runner) soak(ctx context.Context) error {
	dur := r.o.Duration
	if dur == 0 {
		dur = 30 * time.Minute
		if r.o.Quick {
			dur = 3 * time.Minute
		}
	}
	fmt.Fprintln(r.out, "## 15. Soak: a mixed workload under a fault schedule")
	fmt.Fprintln(r.out)
	regular := sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 2 * time.Millisecond}
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
	r1, err := start("regular-1", regular)
	if err != nil {
		return err
	}
	r2, err := start("regular-2", regular)
	if err != nil {
		return err
	}
	r3, err := start("regular-3", regular)
	if err != nil {
		return err
	}
	pre, err := start("prefill", sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	if err != nil {
		return err
	}
	dec, err := start("decode", sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, DecodePerToken: 2 * time.Millisecond})
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "baton-soak")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cfgFile := filepath.Join(dir, "baton.yaml")
	writeWorkers := func(urls ...string) error {
		var b strings.Builder
		b.WriteString("workers:\n")
		for _, u := range urls {
			fmt.Fprintf(&b, "  - url: %s\n", u)
		}
		return os.WriteFile(cfgFile, []byte(b.String()), 0o600)
	}
	if err := writeWorkers(r1.url(), r2.url()); err != nil {
		return err
	}
	common := []string{"--request-timeout", "10s", "--health-check-interval", "1s", "--max-concurrent-requests", "96", "--queue-size", "64",
		"--queue-timeout", "2s", "--cb-timeout-duration", "2s"}
	common = append(common, r.o.BatonFlags...)
	a, err := startBaton(r.o.Binary, -1, append([]string{"--config", cfgFile}, common...)...)
	if err != nil {
		return err
	}
	defer a.stop()
	b, err := startBaton(r.o.Binary, -1, append([]string{"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", pre.url(), "--decode", dec.url()}, common...)...)
	if err != nil {
		return err
	}
	defer b.stop()

	// The fault schedule: a steady start, each fault for a step, the burst, a steady end.
	type fault struct {
		name       string
		begin, end func() error
	}
	none := func() error { return nil }
	var burst atomic.Bool
	faults := []fault{
		{"steady", none, none},
		{"regular engine killed", func() error { return r1.set(true, sim.Faults{}) }, func() error { return r1.set(false, sim.Faults{}) }},
		{"regular engine answers 500", func() error { return r2.set(false, sim.Faults{Status: 500}) }, func() error { return r2.set(false, sim.Faults{}) }},
		{"regular engine hangs", func() error { return r1.set(false, sim.Faults{Hang: true}) }, func() error { return r1.set(false, sim.Faults{}) }},
		{"decode engine killed", func() error { return dec.set(true, sim.Faults{}) }, func() error { return dec.set(false, sim.Faults{}) }},
		{"prefill engine killed", func() error { return pre.set(true, sim.Faults{}) }, func() error { return pre.set(false, sim.Faults{}) }},
		{"burst far over capacity", func() error { burst.Store(true); return nil }, func() error { burst.Store(false); return nil }},
		{"steady (recovery)", none, none},
	}
	step := dur / time.Duration(len(faults))
	fmt.Fprintf(r.out, "%s in %d phases of %s; a regular Baton (two engines, a third added and removed by a configuration reload every 10 s) and a vLLM NIXL PD Baton; 16 clients, half streaming, 5 %% hanging up at a random moment; request deadline %s. Every answer is checked: a 200's ids must be its request's.\n\n",
		dur.Round(time.Second), len(faults), step.Round(time.Second), soakRequestTO)

	tally := &soakTally{counts: map[string]map[string]int{}, lat: map[string][]time.Duration{}}
	var phase atomic.Pointer[string]
	setPhase := func(p string) { phase.Store(&p) }
	setPhase(faults[0].name)
	// Samples every 10 s (5 s in a short run); the first before any load.
	every := 10 * time.Second
	if r.o.Quick || dur < 5*time.Minute {
		every = 5 * time.Second
	}
	began := time.Now()
	var samples []soakSample
	sample := func() {
		s := soakSample{at: time.Since(began), phase: *phase.Load()}
		for k, p := range []*proc{a, b} {
			s.goroutines[k], s.rssMiB[k], s.heap[k] = p.metric("go_goroutines"), mib(p.rssBytes()), p.metric("go_memstats_heap_inuse_bytes")/(1<<20)
		}
		samples = append(samples, s)
	}
	sample()
	// The load ends when the schedule does; a request the harness cut then is not counted.
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	var seq atomic.Int64
	one := func(ctx context.Context) {
		i := seq.Add(1)
		p := *phase.Load()
		target := a
		if i%3 == 0 {
			target = b // a third through the PD pair
		}
		outcome, lat, problem := r.soakRequest(ctx, target.URL, fmt.Sprintf("soak-%d", i), i%2 == 0, rand.IntN(20) == 0, tally)
		if ctx.Err() != nil && outcome != soakOK {
			return // cut by the harness at the run's end
		}
		tally.add(p, outcome, lat, problem)
	}
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for loadCtx.Err() == nil {
				one(loadCtx)
			}
		})
	}
	wg.Go(func() { // the burst: 150 more clients while it lasts
		for loadCtx.Err() == nil {
			if !burst.Load() {
				time.Sleep(50 * time.Millisecond)
				continue
			}
			var bw sync.WaitGroup
			for range 150 {
				bw.Go(func() { one(loadCtx) })
			}
			bw.Wait()
		}
	})
	var reloads, reloadErrs int
	wg.Go(func() { // a configuration reload every 10 s: the third engine added, then removed
		t := time.NewTicker(10 * time.Second)
		defer t.Stop()
		with := false
		for {
			select {
			case <-loadCtx.Done():
				return
			case <-t.C:
			}
			with = !with
			urls := []string{r1.url(), r2.url()}
			if with {
				urls = append(urls, r3.url())
			}
			if err := writeWorkers(urls...); err != nil || a.cmd.Process.Signal(syscall.SIGHUP) != nil {
				reloadErrs++
			}
			reloads++
		}
	})
	// The fault schedule.
	var faultErrs []string
	tick := time.NewTicker(every)
	for k, f := range faults {
		setPhase(f.name)
		if err := f.begin(); err != nil {
			faultErrs = append(faultErrs, err.Error())
		}
		end := began.Add(time.Duration(k+1) * step)
		for time.Now().Before(end) && ctx.Err() == nil {
			select {
			case <-tick.C:
				sample()
			case <-time.After(time.Until(end)):
			case <-ctx.Done():
			}
		}
		if err := f.end(); err != nil {
			faultErrs = append(faultErrs, err.Error())
		}
	}
	tick.Stop()
	stopLoad()
	wg.Wait()
	// Goroutines back where they were once the load is gone (the clients' idle connections
	// closed, so that Baton's connection goroutines end).
	r.client.CloseIdleConnections()
	base := samples[0].goroutines
	leak := [2]float64{}
	for k, p := range []*proc{a, b} {
		for wait := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			leak[k] = p.metric("go_goroutines") - base[k]
			if leak[k] <= 5 || time.Now().After(wait) {
				break
			}
		}
	}
	sample()

	// The report.
	fmt.Fprintf(r.out, "| phase | %s | p50 ms | p99 ms |\n|---|%s---:|---:|\n", strings.Join(soakOutcomes, " | "), strings.Repeat("---:|", len(soakOutcomes)))
	total := map[string]int{}
	for _, p := range tally.phases {
		row := make([]string, len(soakOutcomes))
		for i, o := range soakOutcomes {
			row[i] = fmt.Sprint(tally.counts[p][o])
			total[o] += tally.counts[p][o]
		}
		lat := tally.lat[p]
		slices.Sort(lat)
		pct := func(q float64) string {
			if len(lat) == 0 {
				return "–"
			}
			return fmt.Sprintf("%.1f", float64(lat[min(len(lat)-1, int(q*float64(len(lat))))].Microseconds())/1000)
		}
		fmt.Fprintf(r.out, "| %s | %s | %s | %s |\n", p, strings.Join(row, " | "), pct(0.5), pct(0.99))
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
	fmt.Fprintln(r.out, "| t | phase | goroutines (regular, PD) | RSS MiB (regular, PD) | heap in use MiB (regular, PD) |\n|---:|---|---:|---:|---:|")
	for _, s := range samples {
		fmt.Fprintf(r.out, "| %s | %s | %.0f, %.0f | %.1f, %.1f | %.1f, %.1f |\n", s.at.Round(time.Second), s.phase, s.goroutines[0], s.goroutines[1], s.rssMiB[0], s.rssMiB[1], s.heap[0], s.heap[1])
	}
	fmt.Fprintf(r.out, "\nGoroutines once the load ended, against the start: %+.0f (regular), %+.0f (PD).\n\n", leak[0], leak[1])
	var failed []string
	for _, o := range soakFailing {
		if total[o] > 0 {
			failed = append(failed, fmt.Sprintf("%d %s", total[o], o))
		}
	}
	if leak[0] > 5 || leak[1] > 5 {
		failed = append(failed, fmt.Sprintf("goroutines %+.0f, %+.0f after the load", leak[0], leak[1]))
	}
	if total[soakOK] == 0 {
		failed = append(failed, "no request answered")
	}
	failed = append(failed, faultErrs...)
	if len(failed) > 0 {
		fmt.Fprintf(r.out, "**Failed**: %s\n\n", strings.Join(failed, "; "))
		for _, p := range tally.problems {
			fmt.Fprintf(r.out, "- %s\n", p)
		}
		fmt.Fprintln(r.out)
		r.failed = append(r.failed, "soak: "+strings.Join(failed, "; "))
	}
	return nil
}

// soakRequest sends one completion with the request id rid, streamed or not, the client
// hanging up at a random moment when leave is set, and judges what came back.
func (r *runner) soakRequest(ctx context.Context, base, rid string, stream, leave bool, t *soakTally) (outcome string, lat time.Duration, problem string) {
	body := fmt.Sprintf(`{"model":%q,"prompt":"soak %s","max_tokens":8,"ignore_eos":true,"stream":%v}`, benchModel, rid, stream)
	ctx, cancel := context.WithTimeout(ctx, soakRequestTO+5*time.Second)
	defer cancel()
	var left atomic.Bool
	if leave {
		t := time.AfterFunc(time.Duration(rand.IntN(30))*time.Millisecond, func() { left.Store(true); cancel() })
		defer t.Stop()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return soakUnexpect, 0, err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", rid)
	began := time.Now()
	resp, err := r.client.Do(req)
	if err != nil {
		return soakTransportError(ctx, &left, err, false)
	}
	defer resp.Body.Close()
	b, rerr := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	lat = time.Since(began)
	if rerr != nil {
		o, _, p := soakTransportError(ctx, &left, rerr, true)
		return o, lat, p
	}
	switch resp.StatusCode {
	case http.StatusOK:
		if p := soakCheckIDs(b, rid, stream); p != "" {
			if strings.HasPrefix(p, "cut") {
				return soakCut, lat, ""
			}
			return soakMixed, lat, p
		}
		return soakOK, lat, ""
	case http.StatusTooManyRequests, http.StatusServiceUnavailable, http.StatusGatewayTimeout, http.StatusBadGateway, http.StatusInternalServerError:
		var env struct {
			Error struct {
				Message string `json:"message"`
				Code    any    `json:"code"`
			} `json:"error"`
		}
		if json.Unmarshal(b, &env) != nil || env.Error.Message == "" {
			return soakUnexpect, lat, fmt.Sprintf("%d without the OpenAI envelope: %.200s", resp.StatusCode, b)
		}
		switch resp.StatusCode {
		case http.StatusBadGateway:
			return soakBadGW, lat, ""
		case http.StatusInternalServerError:
			if env.Error.Code == openai.CodeInternalError {
				return soakUnexpect, lat, "Baton's own 500: " + env.Error.Message
			}
			return soakEngineErr, lat, ""
		}
		if resp.Header.Get("Retry-After") == "" {
			t.noRetry.Add(1)
		}
		n, _ := t.codes.LoadOrStore(fmt.Sprintf("%d %v", resp.StatusCode, env.Error.Code), new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		return soakRefused, lat, ""
	}
	return soakUnexpect, lat, fmt.Sprintf("status %d: %.200s", resp.StatusCode, b)
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

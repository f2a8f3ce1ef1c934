package cli

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/baton-llm/baton/internal/app"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// checkWait is how long `baton check` waits for the workers to register, unless --wait says.
const checkWait = 30 * time.Second

// checkFlags takes check's own flags out of args: --json (the report as JSON) and --wait
// DURATION (how long to wait for the workers to register).
func checkFlags(args []string) (asJSON bool, wait time.Duration, rest []string, err error) {
	wait = checkWait
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "--json":
			asJSON = true
		case a == "--wait" && i+1 < len(args):
			i++
			if wait, err = time.ParseDuration(args[i]); err != nil || wait < 0 {
				return false, 0, nil, fmt.Errorf("check: --wait %q is not a duration (like 30s)", args[i])
			}
		case strings.HasPrefix(a, "--wait="):
			if wait, err = time.ParseDuration(a[len("--wait="):]); err != nil || wait < 0 {
				return false, 0, nil, fmt.Errorf("check: %q is not a duration (like 30s)", a)
			}
		default:
			rest = append(rest, a)
		}
	}
	return asJSON, wait, rest, nil
}

// runCheck is `baton check`: with the serve configuration (flags or --config), it registers
// the workers, sends every prefill/decode pair that can meet one small generation through the
// PD path and every regular worker one small completion, and reports what each answered — for
// a pair, what its KV handoff really was. It fails when nothing could be checked, when a pair
// fails or its decode would recompute (none-*), when a regular worker fails, and when a worker
// took part in no check (with the reason: unreachable, no compatible partner, no model in
// common). --json writes the report as one JSON object, for CI pipelines.
func runCheck(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	asJSON, wait, args, err := checkFlags(args)
	if err != nil {
		return err
	}
	cfg, err := config.Parse(args, stdout)
	if err != nil {
		return err
	}
	g, err := app.New(cfg, slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		return err
	}
	bg, stop := context.WithCancel(ctx)
	defer func() { stop(); g.Wait() }()
	g.Start(bg)
	registered(ctx, g.Registry, wait)
	rep := check(ctx, g, cfg.PDDisaggregation)
	if asJSON {
		var b bytes.Buffer
		if err := json.Indent(&b, openai.MarshalJSON(rep), "", "  "); err != nil {
			return err
		}
		fmt.Fprintln(stdout, b.String())
	} else {
		rep.write(stdout)
	}
	if !rep.OK {
		return fmt.Errorf("check: %s", rep.Verdict)
	}
	return nil
}

// checkReport is what `baton check` found.
type checkReport struct {
	OK      bool           `json:"ok"`
	Verdict string         `json:"verdict"`
	Pairs   []pairResult   `json:"pairs"`
	Workers []workerResult `json:"workers"`
	// Unservable are the models the configuration or the engines name that no request could be
	// sent for now, each with why (what /readiness says).
	Unservable []string `json:"unservable,omitempty"`
}

type pairResult struct {
	Prefill string `json:"prefill"`
	Decode  string `json:"decode"`
	Runtime string `json:"runtime"`
	Model   string `json:"model"`
	Status  int    `json:"status"`
	Handoff string `json:"handoff"`
	OK      bool   `json:"ok"`
}

type workerResult struct {
	URL    string `json:"url"`
	Role   string `json:"role"`
	Status int    `json:"status,omitempty"` // a regular worker's answer
	OK     bool   `json:"ok"`
	// Cause names why it is not OK, for programs: wrong_key, refused, timeout, not_an_engine,
	// unreachable (its registration), model_missing (its configuration names a model its engine
	// does not serve), bootstrap_port_mismatch (an SGLang prefill configured with another
	// bootstrap port than its engine reports), answer (its check request failed), no_partner,
	// pair_failed, role_unused.
	Cause  string `json:"cause,omitempty"`
	Reason string `json:"reason,omitempty"` // why it is not OK, in words
}

// check sends every pair that can meet (pd) and every regular worker one request, and says of
// every worker whether it took part in a check that passed.
func check(ctx context.Context, g *app.Gateway, pd bool) checkReport {
	var rep checkReport
	snap := g.Registry.Snapshot()
	partners := map[*worker.Worker]string{} // why a PD worker took part in no good pair
	good := map[*worker.Worker]bool{}
	if pd {
		rep.Pairs = checkPairs(ctx, g, partners, good)
	}
	bad := 0
	for _, p := range rep.Pairs {
		if !p.OK {
			bad++
		}
	}
	for _, w := range snap.Workers {
		r := workerResult{URL: config.RedactURL(w.URL), Role: w.Role}
		switch {
		case !w.Registered():
			r.Cause, r.Reason = "unreachable", "never registered (its engine did not answer /v1/models or its info route)"
			if e := w.LastRegistrationError(); e != nil {
				r.Cause, r.Reason = e.Cause, e.Message
			}
		case len(w.Info().Unserved) > 0:
			r.Cause, r.Reason = "model_missing", fmt.Sprintf("its configuration names %s, which its engine does not serve (GET /v1/models)", strings.Join(w.Info().Unserved, ", "))
		case w.BootstrapMismatch() != "":
			r.Cause, r.Reason = "bootstrap_port_mismatch", w.BootstrapMismatch()
		case w.Role == config.RoleRegular:
			r.Status, r.Cause, r.Reason = checkWorker(ctx, g, w)
			r.OK = r.Reason == ""
		case !pd:
			r.Cause, r.Reason = "role_unused", "a "+w.Role+" worker without --pd-disaggregation: nothing routes to it"
		case good[w]:
			r.OK = true
		case partners[w] != "":
			r.Cause, r.Reason = "no_partner", partners[w]
		default:
			r.Cause, r.Reason = "pair_failed", "its pairs fail (see the pairs)"
		}
		rep.Workers = append(rep.Workers, r)
	}
	checked, failed := len(rep.Pairs), bad
	for _, r := range rep.Workers {
		if r.Role == config.RoleRegular && r.Status != 0 {
			checked++
		}
		if !r.OK {
			failed++
		}
	}
	_, rep.Unservable = g.Server.Director().Readiness() // every model that cannot be served, ready or not
	switch {
	case len(rep.Unservable) > 0 && checked > 0 && bad == 0 && failed == 0:
		rep.Verdict = fmt.Sprintf("%d model(s) cannot be served: %s", len(rep.Unservable), strings.Join(rep.Unservable, "; "))
	case checked == 0:
		rep.Verdict = "nothing could be checked: no pair of a prefill and a decode that can meet, and no regular worker answered (see each worker's reason)"
	case bad > 0:
		rep.Verdict = fmt.Sprintf("%d pair(s) do not hand off their KV", bad)
	case failed > 0:
		rep.Verdict = fmt.Sprintf("%d worker(s) took part in no passing check (see each worker's reason)", failed)
	default:
		rep.OK, rep.Verdict = true, fmt.Sprintf("%d check(s) passed", checked)
	}
	return rep
}

// checkPairs sends every prefill/decode pair that can meet one request; partners records, for
// a worker that meets nobody, why.
func checkPairs(ctx context.Context, g *app.Gateway, partners map[*worker.Worker]string, good map[*worker.Worker]bool) []pairResult {
	var out []pairResult
	prefills, decodes := roleWorkers(g.Registry, config.RolePrefill), roleWorkers(g.Registry, config.RoleDecode)
	met := map[*worker.Worker]bool{}
	for _, p := range prefills {
		for _, d := range decodes {
			if !g.Selector.Compatible(p, d) {
				continue
			}
			model, ok := sharedModel(p, d)
			if !ok {
				partners[p] = cmp.Or(partners[p], "no model in common with a compatible decode")
				partners[d] = cmp.Or(partners[d], "no model in common with a compatible prefill")
				continue
			}
			met[p], met[d] = true, true
			status, handoff, consumed := checkPair(ctx, g, worker.Pair{Prefill: p, Decode: d}, model)
			r := pairResult{Prefill: config.RedactURL(p.URL), Decode: config.RedactURL(d.URL), Runtime: p.Runtime(), Model: model, Status: status, Handoff: handoff}
			switch {
			case status != http.StatusOK || handoff == "" || strings.HasPrefix(handoff, pd.HandoffNonePrefix) || handoff == pd.HandoffRecomputed:
			case consumed == pd.VerdictUnknown:
				// Relayed, but nothing says the decode used it: not a green light.
				r.Handoff += " (unverified: the decode's usage has no prompt_tokens_details.cached_tokens; start vLLM with --enable-prompt-tokens-details)"
			default:
				r.OK, good[p], good[d] = true, true, true
			}
			out = append(out, r)
		}
	}
	for _, w := range append(prefills, decodes...) {
		if !met[w] && partners[w] == "" {
			other := "decode"
			if w.Role == config.RoleDecode {
				other = "prefill"
			}
			partners[w] = fmt.Sprintf("no registered %s it can hand KV to or from (runtimes and KV connectors must agree)", other)
		}
	}
	return out
}

// checkWorker sends a regular worker one small completion, bounded by the request timeout (at
// most a minute); it returns the status and, when it failed, the cause (timeout: no answer in
// time; answer: another failure) and why.
func checkWorker(ctx context.Context, g *app.Gateway, w *worker.Worker) (status int, cause, why string) {
	model := ""
	if ms := w.Info().Models; len(ms) > 0 {
		model = ms[0].ID
	}
	body := fmt.Sprintf(`{"model":%q,"prompt":"baton check","max_tokens":2}`, model)
	limit := min(time.Minute, cmp.Or(g.Config.RequestTimeout, time.Minute))
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	in := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/completions", strings.NewReader(body))
	rec := httptest.NewRecorder()
	err := g.Proxy.Forward(rec, in, w, &proxy.Call{Path: "/v1/completions", Body: []byte(body)})
	var f *outcome.Failure
	switch {
	case ctx.Err() != nil || errors.As(err, &f) && f.Cause != nil && outcome.IsTimeout(f.Cause):
		return http.StatusGatewayTimeout, "timeout", fmt.Sprintf("no answer within %s (--request-timeout, at most a minute)", limit)
	case errors.As(err, &f) && (f.Status == http.StatusUnauthorized || f.Status == http.StatusForbidden):
		return f.Status, "wrong_key", keyRefused(f.Status)
	case errors.As(err, &f):
		return f.ClientStatus(), "answer", fmt.Sprintf("answered %d", f.ClientStatus())
	case err != nil:
		return http.StatusBadGateway, "answer", "failed: " + err.Error()
	case rec.Code == http.StatusUnauthorized || rec.Code == http.StatusForbidden:
		return rec.Code, "wrong_key", keyRefused(rec.Code)
	case rec.Code != http.StatusOK:
		return rec.Code, "answer", fmt.Sprintf("answered %d", rec.Code)
	}
	return rec.Code, "", ""
}

// keyRefused says why an engine that lists its models refused a generation with status.
func keyRefused(status int) string {
	return fmt.Sprintf("answered %d to a generation: the engine wants a key and Baton's (--api-key, --worker-api-key or the worker's api_key) is not it", status)
}

// write prints the report as tables.
func (rep checkReport) write(out io.Writer) {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	if len(rep.Pairs) > 0 {
		fmt.Fprintln(tw, "PREFILL\tDECODE\tRUNTIME\tMODEL\tSTATUS\tHANDOFF")
		for _, p := range rep.Pairs {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", p.Prefill, p.Decode, p.Runtime, p.Model, p.Status, p.Handoff)
		}
		fmt.Fprintln(tw)
	}
	fmt.Fprintln(tw, "WORKER\tROLE\tOK\tCAUSE\tWHY NOT")
	for _, w := range rep.Workers {
		ok := "yes"
		if !w.OK {
			ok = "no"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", w.URL, w.Role, ok, w.Cause, w.Reason)
	}
	for _, m := range rep.Unservable {
		fmt.Fprintf(tw, "\nUNSERVABLE\t%s\n", m)
	}
	_ = tw.Flush()
	fmt.Fprintln(out, rep.Verdict)
}

// registered waits until every worker registered and took traffic, or wait passed.
func registered(ctx context.Context, reg *worker.Registry, wait time.Duration) {
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		all := true
		for _, w := range reg.Snapshot().Workers {
			all = all && w.Registered() && w.Ready()
		}
		if all {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func roleWorkers(reg *worker.Registry, role string) []*worker.Worker {
	var out []*worker.Worker
	for _, w := range reg.Snapshot().Workers {
		if w.Role == role && w.Registered() {
			out = append(out, w)
		}
	}
	return out
}

// sharedModel returns a model both workers serve ("" when either takes any), or false.
func sharedModel(a, b *worker.Worker) (string, bool) {
	am, bm := a.Info().Models, b.Info().Models
	switch {
	case len(am) == 0 && len(bm) == 0:
		return "", true
	case len(am) == 0:
		return bm[0].ID, true
	}
	for _, m := range am {
		if len(bm) == 0 {
			return m.ID, true
		}
		for _, n := range bm {
			if m.ID == n.ID {
				return m.ID, true
			}
		}
	}
	return "", false
}

// checkPair sends pair one small completion through the PD path and returns the status, the
// handoff Baton reported, and what the decode's usage said of it (pd.Request.Consumed).
func checkPair(ctx context.Context, g *app.Gateway, pair worker.Pair, model string) (status int, handoff, consumed string) {
	body := fmt.Sprintf(`{"model":%q,"prompt":"baton check: does this pair hand off its KV?","max_tokens":2}`, model)
	if model == "" {
		body = `{"prompt":"baton check: does this pair hand off its KV?","max_tokens":2}`
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	r := &record.Record{}
	in := httptest.NewRequestWithContext(record.With(ctx, r), http.MethodPost, "/v1/completions", strings.NewReader(body))
	req, err := openai.ParseRequest([]byte(body))
	if err != nil {
		return 0, err.Error(), ""
	}
	rec := httptest.NewRecorder()
	preq := &pd.Request{Request: req, Path: "/v1/completions", Rec: r}
	err = g.Dispatcher.Execute(rec, in, preq, pair)
	var f *outcome.Failure
	if errors.As(err, &f) {
		code := openai.CodeUpstreamError
		if f.Answer != nil {
			code = f.Answer.Code
		}
		return f.ClientStatus(), string(r.Handoff) + " (" + code + ")", ""
	}
	if err != nil {
		return http.StatusBadGateway, string(r.Handoff) + " (" + err.Error() + ")", ""
	}
	return rec.Code, string(r.Handoff), preq.Consumed
}

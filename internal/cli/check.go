package cli

import (
	"context"
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
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/worker"
)

// checkWait bounds how long `baton check` waits for the workers to register.
const checkWait = 30 * time.Second

// runCheck is `baton check`: with the serve configuration (flags or --config), it registers
// the workers, sends every prefill/decode pair that can meet one small generation through the
// PD path, and reports what each pair's KV handoff really was. It fails when a pair fails or
// its decode would recompute (none-*), so that a fleet whose every request would silently
// recompute is caught before it serves.
func runCheck(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := config.Parse(args, stdout)
	if err != nil {
		return err
	}
	if !cfg.PDDisaggregation {
		return errors.New("check: nothing to check without --pd-disaggregation (it tests prefill/decode handoffs)")
	}
	g, err := app.New(cfg, slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		return err
	}
	bg, stop := context.WithCancel(ctx)
	defer func() { stop(); g.Wait() }()
	g.Start(bg)
	registered(ctx, g.Registry)
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PREFILL\tDECODE\tRUNTIME\tMODEL\tSTATUS\tHANDOFF")
	bad := 0
	for _, p := range roleWorkers(g.Registry, config.RolePrefill) {
		for _, d := range roleWorkers(g.Registry, config.RoleDecode) {
			if !g.Selector.Compatible(p, d) {
				continue
			}
			model, ok := sharedModel(p, d)
			if !ok {
				continue
			}
			status, handoff, consumed := checkPair(ctx, g, worker.Pair{Prefill: p, Decode: d}, model)
			switch {
			case status != http.StatusOK || handoff == "" || strings.HasPrefix(handoff, pd.HandoffNonePrefix) || handoff == pd.HandoffRecomputed:
				bad++
			case consumed == pd.VerdictUnknown:
				// Relayed, but nothing says the decode used it: not a green light.
				handoff += " (unverified: the decode's usage has no prompt_tokens_details.cached_tokens; start vLLM with --enable-prompt-tokens-details)"
				bad++
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", p.URL, d.URL, p.Runtime(), model, status, handoff)
		}
	}
	_ = tw.Flush()
	if bad > 0 {
		return fmt.Errorf("check: %d pair(s) do not hand off their KV", bad)
	}
	return nil
}

// registered waits until every worker registered and took traffic, or checkWait passed.
func registered(ctx context.Context, reg *worker.Registry) {
	deadline := time.Now().Add(checkWait)
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
	preq := &pd.Request{Request: req, Path: "/v1/completions"}
	err = g.Dispatcher.Execute(rec, in, preq, pair)
	var f *outcome.Failure
	if errors.As(err, &f) {
		code := openai.CodeUpstreamError
		if f.Answer != nil {
			code = f.Answer.Code
		}
		return f.ClientStatus(), r.Handoff + " (" + code + ")", ""
	}
	if err != nil {
		return http.StatusBadGateway, r.Handoff + " (" + err.Error() + ")", ""
	}
	return rec.Code, r.Handoff, preq.Consumed
}

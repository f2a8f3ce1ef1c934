package server

import (
	"encoding/json"
	"sort"

	"net/http"
	"strconv"

	"github.com/baton-llm/baton/internal/openai"
)

// serveModels answers GET /v1/models with the union of the models of every ready worker, each
// as the card its first worker reported.
func (s *Server) serveModels(w http.ResponseWriter, r *http.Request) {
	who := recordOf(r).Who // a tenant sees only the models it may use
	seen, served := map[string]bool{}, map[string]bool{}
	data := []json.RawMessage{}
	for _, wk := range s.d.Registry().Snapshot().Workers {
		in := wk.Info()
		if in == nil || !wk.Ready() {
			continue
		}
		for _, m := range in.Models {
			served[m.ID] = true
			if seen[m.ID] || who != nil && !who.Allows(m.ID) {
				continue
			}
			seen[m.ID] = true
			card := m.Card
			if card == nil {
				card = openai.MarshalJSON(map[string]any{"id": m.ID, "object": "model", "created": 0, "owned_by": in.Runtime})
			}
			data = append(data, card)
		}
	}
	// Aliases beside the names the workers serve, when what they name is served.
	models, _ := s.d.Models()
	aliases := make([]string, 0, len(models))
	for name := range models {
		aliases = append(aliases, name)
	}
	sort.Strings(aliases)
	for _, name := range aliases {
		target := models[name].Serve
		if target == "" || seen[name] || !served[target] || who != nil && !who.Allows(name) {
			continue
		}
		seen[name] = true
		data = append(data, openai.MarshalJSON(map[string]any{"id": name, "object": "model", "created": 0, "owned_by": "baton", "root": target}))
	}
	// Declared adapters Baton loads on demand, where their base model is served.
	if ad := s.d.Adapters(); ad != nil {
		for _, a := range ad.Settings().Adapters {
			if seen[a.Name] || !served[a.Base] || who != nil && !who.Allows(a.Name) {
				continue
			}
			seen[a.Name] = true
			data = append(data, openai.MarshalJSON(map[string]any{"id": a.Name, "object": "model", "created": 0, "owned_by": "baton", "parent": a.Base}))
		}
	}
	body := openai.MarshalJSON(map[string]any{"object": "list", "data": data})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	_, _ = w.Write(body)
}

// `titan report`'s page: one self-contained HTML file. The runs' series are embedded as JSON in a
// <script type="application/json"> block; a small hand-written script draws each plot as inline SVG
// (axes with ticks, a legend naming each run's folder, a hover readout). Nothing is fetched: no
// fonts, libraries or images. The tables (runs, config differences) are plain HTML written here.
//
// DOM contract (tests/unit/tools/report_test.cpp reads it from headless Chromium):
//   <body data-errors="...">                      every script error and unhandled rejection, "" if none
//   <body data-rendered="N">                      set by the script once it drew N plots
//   <svg class="plot" data-metric="ID">           one per recorded metric, created by the script
//     <path class="series" data-run="I">          one per run that recorded the metric
//   <div class="legend" data-metric="ID">         the run folders, in run order
//   <p class="not-recorded" data-metric="ID">     instead of the plot when no run recorded ID
//   <table class="config">                        the config differences (<td class="key">section.key)
#include "titan/tools/report.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <ctime>
#include <sstream>

namespace titan::report {
namespace {

using nlohmann::json;

// Tableau 10: distinguishable, and readable on white.
const char* const kColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                               "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};

std::string color_of(size_t run) { return kColors[run % (sizeof kColors / sizeof kColors[0])]; }

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double v, int digits = 6) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

json value_json(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

std::string duration(double seconds) {
  const long long s = std::llround(seconds);
  char buf[64];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh %02lldm", s / 3600, s / 60 % 60);
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%lldm %02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%llds", s);
  return buf;
}

std::string swatch(size_t run) { return "<span class=\"swatch\" style=\"background:" + color_of(run) + "\"></span>"; }

// ---------------------------------------------------------------------------------------------
// The tables

std::string runs_table(const std::vector<RunMetrics>& runs) {
  std::ostringstream os;
  os << "<table class=\"runs\"><thead><tr><th>run</th><th>train steps logged</th><th>last loss</th>"
        "<th>last validation loss</th><th>starts</th><th>wall time</th></tr></thead><tbody>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunMetrics& r = runs[i];
    const Series loss = r.series("train", "loss"), val = r.series("validation", "loss");
    os << "<tr><td>" << swatch(i) << "<span class=\"folder\">" << escape(r.folder) << "</span>";
    if (r.incomplete_last_line) os << " <span class=\"warn\">(an incomplete last line was left out)</span>";
    os << "</td><td>";
    const auto train = r.records.find("train");
    if (train == r.records.end() || train->second.empty()) os << "none";
    else os << train->second.size() << " (" << train->second.begin()->first << " to " << train->second.rbegin()->first << ")";
    os << "</td><td>" << (loss.empty() ? "&mdash;" : num(loss.rbegin()->second) + " (step " + std::to_string(loss.rbegin()->first) + ")")
       << "</td><td>" << (val.empty() ? "&mdash;" : num(val.rbegin()->second) + " (step " + std::to_string(val.rbegin()->first) + ")")
       << "</td><td>" << r.starts;
    if (!r.resumed_at.empty()) {
      os << " (resumed at step";
      for (size_t k = 0; k < r.resumed_at.size(); ++k) os << (k ? ", " : " ") << r.resumed_at[k];
      os << ")";
    }
    os << "</td><td>" << (r.first_time && r.last_time ? duration(*r.last_time - *r.first_time) : "&mdash;")
       << "</td></tr>\n";
  }
  os << "</tbody></table>\n";
  return os.str();
}

std::string config_section(const std::vector<RunMetrics>& runs, const ConfigTable& t) {
  std::ostringstream os;
  if (t.against_defaults) {
    os << "<h2>Settings other than titan's defaults</h2>\n";
  } else {
    os << "<h2>Config differences</h2>\n";
  }
  if (t.keys.empty()) {
    if (t.notes.empty())
      os << "<p class=\"note\">" << (t.against_defaults ? "Every setting is titan's default."
                                                          : "The runs' configs are identical (job.dump_folder aside).")
         << "</p>\n";
  } else {
    os << "<table class=\"config\"><thead><tr><th>key</th>";
    if (t.against_defaults) os << "<th>default</th><th>" << swatch(0) << escape(runs[0].folder) << "</th>";
    else
      for (size_t i = 0; i < runs.size(); ++i) os << "<th>" << swatch(i) << escape(runs[i].folder) << "</th>";
    os << "</tr></thead><tbody>\n";
    for (size_t k = 0; k < t.keys.size(); ++k) {
      os << "<tr><td class=\"key\">" << escape(t.keys[k]) << "</td>";
      for (const auto& v : t.values[k])
        os << "<td>" << (v.empty() ? "<span class=\"unset\">(unset)</span>" : escape(v)) << "</td>";
      os << "</tr>\n";
    }
    os << "</tbody></table>\n";
  }
  for (const auto& n : t.notes) os << "<p class=\"note warn\">" << escape(n) << "</p>\n";
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// The data the script draws

json page_data(const std::vector<RunMetrics>& runs) {
  json d;
  d["runs"] = json::array();
  for (size_t i = 0; i < runs.size(); ++i) d["runs"].push_back({{"label", runs[i].folder}, {"color", color_of(i)}});
  d["plots"] = json::array();
  for (const PlotSpec& p : plots()) {
    json plot = {{"id", p.id}, {"title", p.title}, {"unit", p.unit}, {"absent", p.absent},
                 {"recorded", recorded(runs, p)}, {"series", json::array()}};
    for (size_t i = 0; i < runs.size(); ++i) {
      const Series s = runs[i].series(p.kind, p.field);
      if (s.empty()) continue;
      json steps = json::array(), values = json::array();
      for (const auto& [step, v] : s) {
        steps.push_back(step);
        values.push_back(value_json(v));
      }
      plot["series"].push_back({{"run", i}, {"steps", std::move(steps)}, {"values", std::move(values)}});
    }
    d["plots"].push_back(std::move(plot));
  }
  return d;
}

// JSON inside <script>: a '<' only occurs inside strings, where \u003c means the same and cannot
// close the element.
std::string script_safe(const std::string& json_text) {
  std::string out;
  for (char c : json_text) {
    if (c == '<') out += "\\u003c";
    else out += c;
  }
  return out;
}

const char* kStyle = R"CSS(
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 24px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.meta, .note { color: #555; } .warn { color: #a33; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f6f6f6; font-weight: 600; }
td.key { font-family: ui-monospace, Menlo, Consolas, monospace; }
.unset { color: #999; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
.folder { font-family: ui-monospace, Menlo, Consolas, monospace; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(480px, 1fr)); gap: 18px; }
figure.plot-box { margin: 0; border: 1px solid #e3e3e3; border-radius: 6px; padding: 10px 12px; }
figure.plot-box figcaption { font-weight: 600; }
svg.plot { width: 100%; height: auto; display: block; }
svg.plot text { font-size: 11px; fill: #444; }
svg.plot .axis line, svg.plot .axis path { stroke: #888; }
svg.plot .axis line.grid-line { stroke: #ececec; }
svg.plot .series { fill: none; stroke-width: 1.6; }
svg.plot .guide { stroke: #999; stroke-dasharray: 3 3; }
.legend { font-size: 12px; display: flex; flex-wrap: wrap; gap: 4px 14px; }
.legend .absent { color: #999; }
.readout { font-size: 12px; color: #333; min-height: 1.4em; font-family: ui-monospace, Menlo, Consolas, monospace; }
.nonfinite { font-size: 12px; color: #a33; }
p.not-recorded { color: #555; margin: 4px 0; }
)CSS";

// Installed first, so that any error of the drawing script lands in the DOM (data-errors).
const char* kErrorCapture = R"JS(
(function () {
  function add(message) {
    var b = document.body;
    b.dataset.errors = (b.dataset.errors ? b.dataset.errors + "\n" : "") + message;
  }
  window.onerror = function (message, source, line, column) { add(message + " (line " + line + ":" + column + ")"); };
  window.addEventListener("unhandledrejection", function (e) { add("unhandled rejection: " + e.reason); });
  window.titanReportError = add;
})();
)JS";

const char* kScript = R"JS(
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var W = 560, H = 300, M = { l: 62, r: 14, t: 10, b: 40 };  // viewBox size and margins
  var data = JSON.parse(document.getElementById("report-data").textContent);

  function svg(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function html(name, cls, parent, text) {
    var e = document.createElement(name);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function value(v) {  // non-finite floats arrive as strings
    if (typeof v === "number") return v;
    return v === "inf" ? Infinity : v === "-inf" ? -Infinity : NaN;
  }
  function fmt(v) {
    if (isNaN(v)) return "nan";
    if (!isFinite(v)) return v > 0 ? "inf" : "-inf";
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2).replace(/\.?0+e/, "e");
    return String(parseFloat(v.toPrecision(6)));
  }
  // About n round numbers (1, 2 or 5 times a power of ten) from lo to hi.
  function ticks(lo, hi, n, integer) {
    var raw = (hi - lo) / n, step = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / step;
    step *= f >= 7.5 ? 10 : f >= 3.5 ? 5 : f >= 1.5 ? 2 : 1;
    if (integer && step < 1) step = 1;
    var out = [], first = Math.ceil(lo / step - 1e-9);
    // Bounded: a span of a few ulps makes lo / step huge, where adding 1 no longer moves the index.
    for (var k = 0; k <= n + 2; k++) {
      var v = (first + k) * step;
      if (v > hi + step * 1e-9) break;
      out.push(parseFloat(v.toPrecision(12)));
    }
    return out;
  }
  function domain(lo, hi, pad) {
    // Equal, or equal but for float rounding: a band around the value.
    if (hi - lo <= 1e-12 * Math.max(Math.abs(lo), Math.abs(hi))) { var d = Math.abs(lo) * 0.05 || 1; return [lo - d, hi + d]; }
    var p = (hi - lo) * pad;
    return [lo - p, hi + p];
  }
  // Keeps, per pixel column, the lowest and highest point (in step order): long runs stay light.
  function decimate(pts, sx) {
    if (pts.length <= 2 * (W - M.l - M.r)) return pts;
    var out = [], col = null, lo = null, hi = null;
    function flush() {
      if (!lo) return;
      if (lo === hi) out.push(lo); else if (lo[0] <= hi[0]) out.push(lo, hi); else out.push(hi, lo);
    }
    pts.forEach(function (p) {
      var c = Math.round(sx(p[0]));
      if (c !== col) { flush(); col = c; lo = hi = p; }
      else { if (p[1] < lo[1]) lo = p; if (p[1] > hi[1]) hi = p; }
    });
    flush();
    return out;
  }
  function nearest(steps, x) {  // index of the step closest to x (steps ascending)
    var a = 0, b = steps.length - 1;
    while (b - a > 1) { var m = (a + b) >> 1; if (steps[m] <= x) a = m; else b = m; }
    return Math.abs(steps[a] - x) <= Math.abs(steps[b] - x) ? a : b;
  }

  function legend(plot, parent) {
    var div = html("div", "legend", parent);
    div.dataset.metric = plot.id;
    var has = {};
    plot.series.forEach(function (s) { has[s.run] = true; });
    data.runs.forEach(function (run, i) {
      var item = html("span", has[i] ? "item" : "item absent", div);
      var sw = html("span", "swatch", item);
      sw.style.background = run.color;
      html("span", "label", item, run.label + (has[i] ? "" : " (not recorded)"));
    });
  }

  function draw(plot, grid) {
    var fig = html("figure", "plot-box", grid);
    fig.dataset.metric = plot.id;
    html("figcaption", "", fig, plot.title);
    var series = plot.series.map(function (s) {
      return { run: s.run, steps: s.steps, values: s.values.map(value) };
    });
    var x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity, nonfinite = [];
    series.forEach(function (s) {
      var bad = [];
      s.values.forEach(function (v, k) {
        x0 = Math.min(x0, s.steps[k]); x1 = Math.max(x1, s.steps[k]);
        if (isFinite(v)) { y0 = Math.min(y0, v); y1 = Math.max(y1, v); } else bad.push(fmt(v) + " at step " + s.steps[k]);
      });
      if (bad.length) nonfinite.push(data.runs[s.run].label + ": " + bad.slice(0, 3).join(", ") + (bad.length > 3 ? " and " + (bad.length - 3) + " more" : ""));
    });
    var xd = domain(x0, x1, 0.02);
    var yd = y0 <= y1 ? domain(y0, y1, 0.05) : [0, 1];
    var sx = function (x) { return M.l + (x - xd[0]) / (xd[1] - xd[0]) * (W - M.l - M.r); };
    var sy = function (y) { return H - M.b - (y - yd[0]) / (yd[1] - yd[0]) * (H - M.t - M.b); };

    var root = svg("svg", { "class": "plot", "data-metric": plot.id, viewBox: "0 0 " + W + " " + H, role: "img" }, fig);
    svg("title", {}, root).textContent = plot.title + " over steps";
    var axes = svg("g", { "class": "axis" }, root);
    ticks(yd[0], yd[1], 5, false).forEach(function (t) {
      var y = sy(t);
      svg("line", { "class": "grid-line", x1: M.l, x2: W - M.r, y1: y, y2: y }, axes);
      svg("line", { x1: M.l - 4, x2: M.l, y1: y, y2: y }, axes);
      svg("text", { x: M.l - 7, y: y + 4, "text-anchor": "end" }, axes).textContent = fmt(t);
    });
    ticks(xd[0], xd[1], 6, true).forEach(function (t) {
      var x = sx(t);
      svg("line", { x1: x, x2: x, y1: H - M.b, y2: H - M.b + 4 }, axes);
      svg("text", { x: x, y: H - M.b + 16, "text-anchor": "middle" }, axes).textContent = fmt(t);
    });
    svg("path", { d: "M" + M.l + "," + M.t + "V" + (H - M.b) + "H" + (W - M.r), fill: "none" }, axes);
    svg("text", { x: (M.l + W - M.r) / 2, y: H - 6, "text-anchor": "middle" }, axes).textContent = "step";
    svg("text", { x: 0, y: 0, transform: "translate(14," + (M.t + H - M.b) / 2 + ") rotate(-90)", "text-anchor": "middle" },
        axes).textContent = plot.unit;

    series.forEach(function (s) {
      var color = data.runs[s.run].color, d = "", segment = [];
      function close() {
        decimate(segment, sx).forEach(function (p, k) { d += (k ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1); });
        segment = [];
      }
      s.values.forEach(function (v, k) { if (isFinite(v)) segment.push([s.steps[k], v]); else close(); });
      close();  // a non-finite value breaks the line
      svg("path", { "class": "series", "data-run": s.run, d: d, stroke: color }, root);
      if (s.steps.length <= 60)
        s.values.forEach(function (v, k) {
          if (isFinite(v)) svg("circle", { "class": "point", cx: sx(s.steps[k]), cy: sy(v), r: 2.2, fill: color }, root);
        });
    });

    // Hover: a guide at the nearest logged step, each run's value there in the readout.
    var guide = svg("line", { "class": "guide", y1: M.t, y2: H - M.b, visibility: "hidden" }, root);
    var readout = html("div", "readout", null, "\u00a0");
    root.addEventListener("mousemove", function (e) {
      var r = root.getBoundingClientRect();
      var x = xd[0] + ((e.clientX - r.left) * W / r.width - M.l) / (W - M.l - M.r) * (xd[1] - xd[0]);
      var best = null;
      series.forEach(function (s) { var k = nearest(s.steps, x); if (best === null || Math.abs(s.steps[k] - x) < Math.abs(best - x)) best = s.steps[k]; });
      guide.setAttribute("x1", sx(best)); guide.setAttribute("x2", sx(best)); guide.setAttribute("visibility", "visible");
      readout.textContent = "step " + best + ":  " + series.map(function (s) {
        var k = nearest(s.steps, best);
        return data.runs[s.run].label + " " + (s.steps[k] === best ? fmt(s.values[k]) : "\u2014");
      }).join("   ");
    });
    root.addEventListener("mouseleave", function () { guide.setAttribute("visibility", "hidden"); readout.textContent = "\u00a0"; });

    legend(plot, fig);
    fig.appendChild(readout);
    if (nonfinite.length) html("div", "nonfinite", fig, "not drawn (non-finite): " + nonfinite.join("; "));
  }

  var grid = document.getElementById("plot-grid"), absent = document.getElementById("not-recorded"), drawn = 0;
  data.plots.forEach(function (plot) {
    try {
      if (plot.recorded) { draw(plot, grid); drawn++; return; }
      var p = html("p", "not-recorded", absent);
      p.dataset.metric = plot.id;
      html("b", "", p, plot.title);
      p.appendChild(document.createTextNode(": not recorded by " + (data.runs.length > 1 ? "any run" : "this run") + " (" + plot.absent + ")"));
    } catch (e) {
      window.titanReportError(plot.id + ": " + (e && e.stack ? e.stack : e));
    }
  });
  document.body.dataset.rendered = String(drawn);
})();
)JS";

}  // namespace

const std::vector<PlotSpec>& plots() {
  static const std::vector<PlotSpec> p = {
      {"loss", "Loss", "train", "loss", "loss", "no train line in metrics.jsonl"},
      {"validation_loss", "Validation loss", "validation", "loss", "loss",
       "validation is off: [validation] enable, with freq and steps"},
      {"lr", "Learning rate", "train", "lr", "learning rate", "no lr in the train lines"},
      {"grad_norm", "Gradient norm", "train", "grad_norm", "gradient norm", "no grad_norm in the train lines"},
      {"tps", "Tokens per second (per device)", "train", "tps", "tokens/s", "no tps in the train lines"},
      {"mfu", "MFU", "train", "mfu_pct", "MFU %",
       "the device's peak FLOP/s is unknown: the CPU and unlisted GPUs (docs/metrics.md)"},
      {"memory", "Peak memory", "train", "memory_gib", "GiB", "no memory_gib in the train lines"},
  };
  return p;
}

bool recorded(const std::vector<RunMetrics>& runs, const PlotSpec& plot) {
  for (const auto& r : runs)
    if (!r.series(plot.kind, plot.field).empty()) return true;
  return false;
}

std::string render_html(const std::vector<RunMetrics>& runs, const ConfigTable& config) {
  std::string title = "titan report:";
  for (const auto& r : runs) title += " " + r.folder;
  char when[64] = "";
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", &tm);

  std::ostringstream os;
  os << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
     << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
     << "<title>" << escape(title) << "</title>\n<style>" << kStyle << "</style></head>\n"
     << "<body data-errors=\"\">\n<script>" << kErrorCapture << "</script>\n"
     << "<h1>titan report</h1>\n<p class=\"meta\">" << runs.size() << " run" << (runs.size() == 1 ? "" : "s")
     << ", from each folder's metrics.jsonl and config.toml; written " << when << ".</p>\n"
     << "<h2>Runs</h2>\n" << runs_table(runs) << config_section(runs, config)
     << "<h2>Metrics over steps</h2>\n"
     << "<noscript><p class=\"warn\">The plots are drawn by the page's script: allow JavaScript.</p></noscript>\n"
     << "<div class=\"grid\" id=\"plot-grid\"></div>\n<div id=\"not-recorded\"></div>\n"
     << "<script type=\"application/json\" id=\"report-data\">"
     << script_safe(page_data(runs).dump(-1, ' ', false, json::error_handler_t::replace)) << "</script>\n"
     << "<script>" << kScript << "</script>\n</body></html>\n";
  return os.str();
}

}  // namespace titan::report

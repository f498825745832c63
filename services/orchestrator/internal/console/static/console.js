// curfew console: live updates of a run's page (Server-Sent Events), the deadline
// countdown, and the run list's refresh. Everything else works without it.
"use strict";

// followRun keeps #live current from the run's event stream. An update waits while the
// keyboard focus is inside the live part (a reason being typed is not wiped out), and
// while a pointer is pressed in it: replacing the part between a button's press and its
// release would lose the click (Cancel, Approve).
function followRun(live) {
  var pending = null;
  var pressing = false;
  function apply(html) {
    if (pressing || (live.contains(document.activeElement) && document.activeElement !== document.body &&
        document.activeElement.tagName !== "BUTTON")) {
      pending = html;
      return;
    }
    pending = null;
    live.innerHTML = html;
    countdown();
  }
  function flush() {
    setTimeout(function () { if (pending !== null) apply(pending); }, 0);
  }
  live.addEventListener("focusout", function (e) {
    if (!live.contains(e.relatedTarget)) flush(); // focus moving within the part waits
  });
  live.addEventListener("pointerdown", function () { pressing = true; });
  // After the release: the click it makes is dispatched first.
  document.addEventListener("pointerup", function () {
    if (!pressing) return;
    pressing = false;
    flush();
  });
  document.addEventListener("pointercancel", function () {
    if (!pressing) return;
    pressing = false;
    flush();
  });
  var es = new EventSource(live.dataset.events);
  es.addEventListener("view", function (e) { apply(e.data); });
  es.addEventListener("end", function () { es.close(); live.dataset.ended = "1"; });
  es.onerror = function () {
    if (live.dataset.ended) es.close();
  };
}

var skew = 0; // server clock - browser clock, in ms

function countdown() {
  var s = document.querySelector("section.summary");
  var el = document.getElementById("countdown");
  if (!s || !el) return;
  var dl = Number(s.dataset.deadline);
  if (!dl || s.dataset.live !== "true") return;
  var left = dl - (Date.now() + skew);
  el.textContent = left > 0 ? "deadline in " + (left / 1000).toFixed(1) + " s" : "deadline passed";
}

function refreshList(box) {
  var every = Number(box.dataset.refresh);
  if (!every) return;
  setInterval(function () {
    if (document.hidden) return;
    var src = box.dataset.src;
    src += (src.indexOf("?") < 0 ? "?" : "&") + "fragment=1";
    fetch(src, { credentials: "same-origin" }).then(function (r) {
      if (r.ok) return r.text();
      throw new Error(r.status);
    }).then(function (html) { box.innerHTML = html; }).catch(function () {});
  }, every);
}

document.addEventListener("DOMContentLoaded", function () {
  var live = document.getElementById("live");
  if (live) {
    skew = Number(live.dataset.serverNow) - Date.now();
    followRun(live);
    countdown();
    setInterval(countdown, 100);
  }
  var rows = document.getElementById("runrows");
  if (rows) refreshList(rows);
});
